"""M=1 GEMV with the weight in cache (L2/L3): the kernel's compute at one row."""
import sys, time, torch
from kvserve.kernels import load_kernels
from kvserve.model.quant import quantize
assert load_kernels()
torch.set_num_threads(1)
ops = torch.ops.kvserve
kind = sys.argv[1]; n, k = int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
q = quantize(torch.randn(n, k), kind); p = ops.pack_quant(q.qs, q.d, q.m)
x = torch.randn(1, k)
for _ in range(50): ops.packed_linear(x, p, kind, n)
times = []
for _ in range(400):
    t = time.perf_counter(); ops.packed_linear(x, p, kind, n); times.append(time.perf_counter() - t)
times.sort()
print(f"{kind} {n}x{k} KB={p.numel()/1e3:.0f} median {times[200]*1e6:.1f} us  best {times[0]*1e6:.1f} us")
