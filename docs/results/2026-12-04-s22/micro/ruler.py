# GEMM-only at 64 rows as `bench roofline` times it: decoder copies as the old rule sized them (19: the fp32
# bytes of 256 MiB; reproduced with cold_mib=128 of bf16) and as now (256 MiB of bf16 -> 30, one per layer)
import time
import torch
from kvserve.kernels import load_kernels; load_kernels()
from kvserve.bench.roofline import measure_gemms, forward_flops, linear_shapes, weight_formats
from kvserve.model.loader import load_model_config, resolve_model_path
path = str(resolve_model_path(None))
cfg = load_model_config(path)
formats = weight_formats("auto", path)
shapes = linear_shapes(cfg)
for rep in range(3):
    for cold in (128, 256):
        sec = measure_gemms(cfg, torch.float32, [64], repeats=3, cold_mib=cold, formats=formats)[64]
        total = sum(sec[s.name] * s.count for s in shapes) * 1e3
        print(f"cold_mib {cold}: forward GEMMs at 64 rows {total:.2f} ms  " +
              "  ".join(f"{s.name} {sec[s.name]*1e6:.0f} us" for s in shapes), flush=True)
