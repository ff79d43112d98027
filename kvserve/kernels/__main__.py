"""``python -m kvserve.kernels [LEVEL ...] [-v]``: build the native kernels' libraries now (every level by
default; set-up does this once), then load the one this CPU runs."""

import logging
import sys

from kvserve.kernels import build, isa, loader

logging.basicConfig(level=logging.INFO, format="%(message)s")
names = [a for a in sys.argv[1:] if not a.startswith("-")]
unknown = [n for n in names if n not in isa.BY_NAME]
if unknown:
    sys.exit(f"kvserve kernels: no level {', '.join(unknown)} (levels: {', '.join(isa.BY_NAME)})")
levels = [isa.BY_NAME[n] for n in names] or list(isa.LEVELS)
try:
    build.build_levels(levels, verbose="-v" in sys.argv)
    print(f"kvserve kernels: built {', '.join(lv.name for lv in levels)} in {build.cache_dir()}")
except build.BuildError as e:
    print(f"kvserve kernels: not built ({e}); the torch fallbacks will be used")
ok = loader.load_kernels()
print(f"kvserve kernels: this CPU runs {loader.loaded_level() if ok else 'the torch fallbacks'}")
