"""M=1 (decode) GEMV rate over weights far bigger than L3: like a decode step, each weight once per pass."""
import sys, time, torch
from kvserve.kernels import load_kernels
from kvserve.model.quant import quantize
assert load_kernels()
threads, kind = int(sys.argv[1]), sys.argv[2]
torch.set_num_threads(threads)
ops = torch.ops.kvserve
torch.manual_seed(0)
ws = []
shapes = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)] * 6   # ~1B-model-like layers
for n, k in shapes:
    w = torch.randn(n, k)
    q = quantize(w, kind)
    ws.append((ops.pack_quant(q.qs, q.d, q.m), n, k))
nbytes = sum(p.numel() for p, _, _ in ws)
xs = {k: torch.randn(1, k) for k in (2048, 8192)}
def run():
    for p, n, k in ws: ops.packed_linear(xs[k], p, kind, n)
run(); run()
times = []
for _ in range(15):
    t = time.perf_counter(); run(); times.append(time.perf_counter() - t)
times.sort()
print(f"{kind} threads={threads} MB={nbytes/1e6:.0f} median {times[7]*1e3:.1f} ms  {nbytes/times[7]/1e9:.2f} GB/s  best {nbytes/times[0]/1e9:.2f}")
