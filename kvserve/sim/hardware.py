"""The hardware catalog: per-device peak FLOP/s per precision, memory, links, price, efficiencies.

Figures live in an editable JSON file (``kvserve/sim/data/hardware.json``; ``--hardware-file``
points at another), so a user can put in their own prices or a calibrated entry.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path

from kvserve.errors import InvalidArgumentError

# a precision a device lacks runs on the next wider one (weight-only quantization)
FALLBACK = {"fp4": "fp8", "fp8": "bf16", "bf16": "fp32", "fp32": None}


@dataclass
class Hardware:
    key: str
    name: str
    hbm_gb: float  # device memory (the CPU entry: RAM)
    hbm_tbps: float
    tflops: dict[str, float]  # dense peak per compute precision
    interconnect_gbps: float  # per device, to its tensor-parallel peers
    host_link_gbps: float  # device <-> host copies (KV offload)
    price_per_hour: float
    # disaggregated prefill: the link a prompt's KV crosses from a prefill to a decode replica, per
    # device (None: the interconnect, e.g. NVLink within a node), and its latency per transfer
    kv_link_gbps: float | None = None
    kv_link_latency_s: float = 20e-6
    mfu: float = 0.6  # achievable fraction of peak FLOP/s
    attn_mfu: float | None = None  # the same for attention (None: as mfu); CPUs gather KV and do worse
    mbu: float = 0.8  # achievable fraction of memory bandwidth
    overhead_s: float = 0.004  # per step
    per_seq_s: float = 0.0  # per sequence per step (sampling, bookkeeping)
    overlap: bool = True  # compute and memory traffic overlap (GPU); a CPU core does one then the other
    allreduce_latency_s: float = 10e-6
    extra: dict[str, object] = field(default_factory=dict)

    def peak_flops(self, precision: str) -> float:
        """FLOP/s at ``precision``, falling back to wider precisions the device does have."""
        p: str | None = precision
        while p is not None:
            if p in self.tflops:
                return self.tflops[p] * 1e12
            p = FALLBACK[p]
        return max(self.tflops.values()) * 1e12

    def native(self, precision: str) -> bool:
        return precision in self.tflops


def load_catalog(path: str | Path | None = None) -> dict[str, Hardware]:
    if path is None:
        text = resources.files("kvserve.sim").joinpath("data", "hardware.json").read_text()
    else:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise InvalidArgumentError(f"cannot read the hardware file: {e}") from e
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidArgumentError(f"the hardware file is not valid JSON: {e}") from e
    known = {f.name for f in fields(Hardware)}
    out = {}
    for key, d in raw.items():
        if key.startswith("_"):
            continue
        unknown = set(d) - known
        if unknown:
            raise InvalidArgumentError(f"hardware {key!r}: unknown field(s) {', '.join(sorted(unknown))}")
        out[key] = Hardware(key=key, **d)
    return out


def get_hardware(key: str, catalog: dict[str, Hardware] | None = None) -> Hardware:
    catalog = catalog or load_catalog()
    if key not in catalog:
        raise InvalidArgumentError(f"unknown hardware {key!r}; known: {', '.join(catalog)}")
    return catalog[key]
