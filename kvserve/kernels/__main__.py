"""``python -m kvserve.kernels``: build the native kernels now (set-up does this once)."""

import logging
import sys

from kvserve.kernels.build import cache_dir, load_kernels

logging.basicConfig(level=logging.INFO, format="%(message)s")
ok = load_kernels(verbose="-v" in sys.argv)
print(f"kvserve kernels: {'built' if ok else 'not built (the torch fallbacks will be used)'} in {cache_dir()}")
