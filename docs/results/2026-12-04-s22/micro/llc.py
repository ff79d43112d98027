import time, torch, statistics
from kvserve.model.layers import PackedLinear
torch.manual_seed(0)
def t(fn, n=7):
    fn(); out=[]
    for _ in range(n):
        t0=time.perf_counter(); fn(); out.append(time.perf_counter()-t0)
    return statistics.median(out)*1e3
with torch.inference_mode():
    x = torch.randn(64,576).bfloat16()
    ups = []
    for total in (64, 128, 256, 384, 512, 768):
        while len(ups)*3072*576*2 < total*2**20:
            ups.append(PackedLinear((torch.randn(3072,576)*0.02).bfloat16(), None))
        def u():
            for d in ups: d(x)
        ms = t(u)
        print(f"{total} MiB: {len(ups)} copies, {ms/len(ups)*1e3:.0f} us/call, {len(ups)*3072*576*2/ms/1e6:.1f} GB/s")
