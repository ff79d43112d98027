"""Native CPU kernels (C++ in ``csrc/``), one library per instruction-set level, and the Python side.

``isa`` names the levels and picks the one this CPU runs (or ``KVSERVE_CPU_ISA``'s); ``build``
compiles a level's library (a wheel's build does every level ahead of time); ``loader`` loads the
chosen one into ``torch.ops.kvserve`` once per process, or logs one line. The engine calls the ops
through ``ops``, whose wrappers then run their pure-torch fallbacks (or raise
``NativeKernelsUnavailable`` where the caller has another path). ``python -m kvserve.kernels``
builds every level now (``make install`` does).
"""

from kvserve.kernels.loader import kernels_available, load_kernels, loaded_from, loaded_level

__all__ = ["kernels_available", "load_kernels", "loaded_from", "loaded_level"]
