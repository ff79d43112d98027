# The LM head at 64 rows as bench roofline times it: warm (called again and again, as before) vs after a 256 MiB read
import time, statistics, torch
from kvserve.kernels import load_kernels; load_kernels()
from kvserve.bench import roofline as rf
from kvserve.model.loader import load_model_config, resolve_model_path
path = str(resolve_model_path(None)); cfg = load_model_config(path)
fmt = rf.weight_formats("auto", path)["lm_head"]
head = rf.make_linear(torch.randn(49152, 576).mul_(0.02), None, fmt)
x = torch.randn(64, 576)
flush = torch.ones(256 * 2**20 // 4)
with torch.inference_mode():
    for rep in range(3):
        warm = rf._timed(lambda: head(x), 0.05, 3)
        cold = rf._timed_cold(lambda: head(x), flush, 5)
        print(f"LM head, 64 rows: warm {warm*1e3:.2f} ms, after a 256 MiB read {cold*1e3:.2f} ms", flush=True)
