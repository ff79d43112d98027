"""Optional native CPU kernels, compiled on first use; pure torch is the fallback.

``paged_decode`` reads keys and values in place through the block tables instead of
gathering them into a padded copy first (which cost more than the attention itself).
It is built once per machine with torch's C++ extension loader (a C++ compiler is needed;
``KVSERVE_NO_NATIVE=1`` turns it off) and cached under ~/.cache/torch_extensions.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)
_native: ModuleType | None | bool = None  # None: not tried yet; False: unavailable


def native() -> ModuleType | None:
    global _native
    if _native is None:
        _native = False
        if os.environ.get("KVSERVE_NO_NATIVE") != "1":
            try:
                from torch.utils.cpp_extension import load

                src = Path(__file__).parent / "csrc" / "paged_decode.cpp"
                _native = load(name="kvserve_paged_decode", sources=[str(src)],
                               extra_cflags=["-O3", "-march=native", "-fopenmp-simd"], verbose=False)
            except Exception as e:  # no compiler, no headers: fall back to torch
                log.warning("native CPU kernels unavailable, using the torch path: %s", str(e).splitlines()[0][:200])
    return _native or None
