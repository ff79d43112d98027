"""Native CPU kernels (C++, built for this machine on first use) and the Python side of each.

``load_kernels()`` compiles every source in ``csrc/`` into one library that registers its ops
under ``torch.ops.kvserve``; it returns False (after one clear log line) where no compiler is
found or the build fails. The engine calls the ops through ``kvserve.kernels.ops``, whose wrappers
then run their pure-torch fallbacks (or raise ``NativeKernelsUnavailable`` where the caller has
another path). ``python -m kvserve.kernels`` builds ahead of time (``make install`` does it).
"""

from kvserve.kernels.build import kernels_available, load_kernels

__all__ = ["kernels_available", "load_kernels"]
