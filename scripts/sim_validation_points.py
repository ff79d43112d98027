"""Writes kvserve/sim/data/validation.json: the published GPU measurements kvserve sim validate scores
(values typed in by hand from the sources named beside them). Run from the repository root."""
import json
TRT = ("https://github.com/NVIDIA/TensorRT-LLM/blob/00f37686aa854010d68bcbd0f4ab000221541ca6/"
       "docs/source/performance/perf-overview.md")
NIM = "https://docs.nvidia.com/nim/benchmarking/llm/1.0.0/performance"
SGL = ("https://github.com/sgl-project/sglang/blob/120affb9613cc3f5bcd055ec09c7621d3ced0ebc/"
       "benchmark/benchmark_vllm_060/README.md")
pts = []
def add(**k): pts.append(k)
trt_rows = {  # (isl, osl): {column: value}
    (128, 128): {"h200-8b": 27911, "h100-8b": 28312, "h200-70b": 3803, "h100-70b": 6378},
    (2048, 128): {"h200-8b": 3538, "h100-8b": 3450, "h200-70b": 442, "h100-70b": 762},
    (5000, 500): {"h200-8b": 3902, "h100-8b": 3459, "h200-70b": 566, "h100-70b": 898},
    (1000, 1000): {"h200-70b": 2909, "h100-70b": 4205},
}
cols = {"h200-8b": ("h200", "llama-3.1-8b", 1, "Llama 3.1 8B table, H200 TP1 (FP8) column"),
        "h100-8b": ("h100-sxm", "llama-3.1-8b", 1, "Llama 3.1 8B table, H100 TP1 (FP8) column"),
        "h200-70b": ("h200", "llama-3.1-70b", 1, "Llama 3.3 70B table, H200 TP1 (FP8) column"),
        "h100-70b": ("h100-sxm", "llama-3.1-70b", 2, "Llama 3.3 70B table, H100 TP2 (FP8) column")}
nreq = {(128, 128): 30000, (2048, 128): 3000, (5000, 500): 1500, (1000, 1000): 3000}
for (i, o), row in trt_rows.items():
    for col, v in row.items():
        gpu, model, tp, where = cols[col]
        add(id=f"trtllm-perf-{col}-{i}-{o}", engine="trtllm", source=TRT, where=f"{where}, row {i}/{o}",
            engine_version="TensorRT-LLM v1.0 (PyTorch backend, trtllm-bench throughput)",
            hardware=gpu, model=model, tp=tp, weights="fp8", kv="fp8",
            workload={"kind": "fixed", "input_len": i, "output_len": o, "num_prompts": nreq[(i, o)]},
            load={"concurrency": None}, metric="output_tok_s", value=v,
            note="offline: every request queued at once; Total Output Throughput (tokens/sec)")
nim = [(1, 406.77, 18.58, 51.67), (5, 546.7, 21.83, 218.48), (25, 688.69, 38.75, 623.4),
       (50, 834.51, 59.73, 814.37), (100, 7996.25, 92.91, 917.26), (150, 34794.22, 92.86, 920.9),
       (200, 61680.22, 93.06, 920.54), (250, 88605.32, 93.2, 920.12)]
for c, ttft, itl, thr in nim:
    for metric, v in (("output_tok_s", thr), ("ttft_mean_ms", ttft), ("itl_mean_ms", itl)):
        add(id=f"nim-70b-h100x2-c{c}-{metric}", engine="trtllm", source=NIM,
            where="Llama-3.3-70b-instruct Results, Version 1.8.0, 2 x H100 80G, fp8 TP2, "
                  f"5000 Input Tokens / 500 Output Tokens, concurrency {c}",
            engine_version="NIM 1.8.0 (TensorRT-LLM backend), genai-perf/AIPerf",
            hardware="h100-sxm", model="llama-3.1-70b", tp=2, weights="fp8", kv="fp8",
            workload={"kind": "fixed", "input_len": 5000, "output_len": 500, "num_prompts": None},
            load={"concurrency": c}, metric=metric, value=v,
            note="closed loop at this concurrency; NIM reports averages; Throughput is output tokens/s")
share = {"kind": "sharegpt", "input_mean": 227, "output_mean": 194}
for eng, ver in (("sglang", "SGLang v0.3.0 (--enable-torch-compile on the 8B, --disable-radix-cache)"),
                 ("vllm", "vLLM v0.6.0 (--num-scheduler-steps 10)")):
    for gpu, model, tp, table, thr in (("a100", "llama-3.1-8b", 1, "Llama 3.1 8B Instruct 1 x A100 80G",
                                          {"sglang": 4281.51, "vllm": 4132.37}),
                                         ("h100-sxm", "llama-3.1-70b", 4, "Llama 3.1 70B Instruct 4 x H100 80G",
                                          {"sglang": 3856.01, "vllm": 3700.64})):
        tag = "8b-a100" if tp == 1 else "70b-h100x4"
        common = dict(engine=eng, source=SGL, engine_version=ver, hardware=gpu, model=model, tp=tp,
                      weights="bf16", kv="bf16")
        if eng == "sglang":  # v0.3.0 predates the overlap scheduler (v0.4): host time between steps
            common["engine_flags"] = {"overlap_host": False, "late_admission": False}
        add(id=f"sglang-readme-{eng}-{tag}-offline", where=f"Offline benchmark results, {table}, {eng}",
            workload=dict(share, num_prompts=5000), load={"concurrency": None}, metric="output_tok_s",
            value=thr[eng], note="ShareGPT, 5000 prompts at once; Output token throughput", **common)
        online = {("sglang", 1): ((31.98, 13.17), (35.68, 17.85)), ("vllm", 1): ((100.48, 14.14), (120.39, 17.09)),
                  ("sglang", 4): ((53.94, 25.03), (58.11, 33.07)), ("vllm", 4): ((179.15, 23.58), (207.12, 29.15))}
        for rps, (ttft, tpot) in zip((4, 8), online[(eng, tp)]):
            for metric, v in (("ttft_p50_ms", ttft), ("tpot_p50_ms", tpot)):
                use = not (eng == "vllm" and metric == "ttft_p50_ms")
                add(id=f"sglang-readme-{eng}-{tag}-rps{rps}-{metric}", where=f"Online benchmark results, {table}, "
                    f"RPS {rps}, {eng}", workload=dict(share, num_prompts=1200 if rps == 4 else 2400), load={"request_rate": rps},
                    metric=metric, value=v, use=use,
                    note=("Median TTFT / Median TPOT; Poisson arrivals" if use else
                          "not fitted or scored: vLLM 0.6.0's multi-step scheduling (10 steps per schedule) "
                          "delays first tokens in a way the simulator does not model"), **common)
# SGLang's cookbook (its own project): Llama 3.1 70B, 8 x A100, TP8, SGLang 0.5.6, default flags, bench_serving
# random dataset without --random-range-ratio (lengths uniform in [1, L]: the published totals average L/2),
# closed loops of 5c prompts (c=1: 10), scored over the whole run; "Concurrency" is the run's mean in flight
COOK = ("https://github.com/sgl-project/sgl-cookbook/blob/172d80bdea5035d636774eb90d11c911cfa22590/"
        "docs/autoregressive/Llama/Llama3.1.md")
cook = {  # (section, input len, concurrency, prompts, "Concurrency"): output tok/s, mean/median TTFT, median TPOT,
    # mean/median ITL
    ("5.1.1.1 Low Concurrency", 1000, 1, 10, 1.00): (52.88, 131.61, 131.77, 18.63, 18.64, 18.64),
    ("5.1.1.2 Medium Concurrency", 1000, 16, 80, 13.47): (513.48, 264.84, 147.02, 26.08, 25.76, 23.95),
    ("5.1.1.3 High Concurrency", 1000, 100, 500, 89.70): (1919.38, 245.98, 184.22, 48.67, 46.34, 33.46),
    ("5.1.2.1 Low Concurrency", 8000, 1, 10, 1.00): (50.69, 395.25, 318.02, 18.81, 18.83, 18.81),
    ("5.1.2.2 Medium Concurrency", 8000, 16, 80, 14.18): (389.0, 603.42, 531.82, 36.73, 35.36, 25.72),
    ("5.1.2.3 High Concurrency", 8000, 64, 320, 60.01): (788.27, 633.32, 616.38, 82.85, 75.08, 34.12),
}
names = ("output_tok_s", "ttft_mean_ms", "ttft_p50_ms", "tpot_p50_ms", "itl_mean_ms", "itl_p50_ms")
labels = ("Output token throughput (tok/s)", "Mean TTFT (ms)", "Median TTFT (ms)", "Median TPOT (ms)",
          "Mean ITL (ms)", "Median ITL (ms)")
# the six runs went to one server in this order (one deployment command for the section), and bench_serving
# seeds its draws (--seed 1): run k's first prompts are run k-1's, so each run finds them in the radix cache
cook_runs: list[dict] = []  # the series: every run of the section, in order
for (section, isl, c, n, mean_c), values in cook.items():
    run = {"workload": {"kind": "random", "input_len": isl, "output_len": 1000, "range_ratio": 0.0, "num_prompts": n,
                        "seed": 1}, "load": {"concurrency": c}}
    for metric, label, v in zip(names, labels, values):
        add(id=f"sgl-cookbook-70b-a100x8-{isl}-c{c}-{metric}", engine="sglang", source=COOK,
            where=f"5. Benchmark, 5.1 Speed Benchmark, {section} (--random-input-len {isl} --random-output-len 1000 "
                  f"--num-prompts {n} --max-concurrency {c}), line '{label}'",
            engine_version="SGLang 0.5.6 (sglang serve --tp 8, defaults), bench_serving",
            hardware="a100", model="llama-3.1-70b", tp=8, weights="bf16", kv="bf16",
            workload=run["workload"], load=dict(run["load"], mean_concurrency=mean_c),
            series="sgl-cookbook-70b-a100x8", run=len(cook_runs), metric=metric, value=v,
            note="bench_serving's random dataset, drawn as it draws it (numpy seeded with its default --seed 1: the "
                 "draws reproduce every run's published input and output token totals); scored over the whole run "
                 "as bench_serving scores it, after its one warm-up request and after the runs before it on the same "
                 "server (its series), whose prompts share each index's prefix. The A100's memory is not stated "
                 "(80 GB assumed) nor the dtype (bf16, the checkpoint's); mean_concurrency is the run's printed "
                 "'Concurrency' (compared with the simulated one in docs/simulator.md)")
    cook_runs.append(run)
# AMD's ROCm fork of vLLM (v0.10.0, V1 engine): its dev-docker README's latency table, benchmark_latency.py
# (a static batch of B prompts handed to LLM.generate at once; mean wall time of 5 runs after 3 warm-ups)
ROCM = "https://github.com/ROCm/vllm/blob/7802e2b729300adb67a665783292cd25684d1292/docs/dev-docker/README.md"
rocm = {128: (17.188, 17.827, 18.492, 20.227, 21.565, 24.999, 32.641, 46.195),
        2048: (17.214, 18.012, 18.984, 20.111, 22.547, 25.987, 34.961, 52.283)}
for isl, secs in rocm.items():
    for b, v in zip((1, 2, 4, 8, 16, 32, 64, 128), secs):
        add(id=f"rocm-vllm-70b-mi300x8-{isl}-2048-bs{b}-batch_latency_s", engine="vllm", source=ROCM,
            where=f"Performance Results, Latency Measurements, Llama 3.1 70B (amd/Llama-3.1-70B-Instruct-FP8-KV), "
                  f"FP8, TP Size 8, Batch Size {b}, Input {isl}, Output 2048, column 'MI300X Latency (sec)'",
            engine_version="vLLM v0.10.0, AMD's ROCm fork (image rocm6.4.1_vllm_0.10.0_20250812, V1 engine), "
                           "benchmark_latency.py --dtype float16 --gpu-memory-utilization 0.9",
            hardware="mi300x", model="llama-3.1-70b", tp=8, weights="fp8", kv="bf16",
            workload={"kind": "fixed", "input_len": isl, "output_len": 2048, "num_prompts": b},
            load={"concurrency": None}, metric="batch_latency_s", value=v,
            note="end-to-end seconds of one batch of B requests, all generating 2048 tokens; 8 x MI300X 192 GB 750 W; "
                 "16-bit KV (no --kv-cache-dtype on the latency command). The README's throughput table is left out: "
                 "its runs keep 1,500-3,200 sequences in flight (--max-num-seqs) and its column is only 'Throughput "
                 "(tokens/s)'")
for p in pts:
    p.setdefault("use", True)
doc = {"_about": "Published GPU measurements of vLLM, SGLang and TensorRT-LLM, each with its source URL, where in the "
       "source it is, the workload and settings, and the value as published. kvserve/sim/validate.py simulates each "
       "and fits the free cost terms on the 'fit' half (every other used point, in file order) and scores the rest. "
       "Llama 3.3 70B has Llama 3.1 70B's shapes (the llama-3.1-70b preset). ShareGPT workloads are synthesized with "
       "the runs' mean lengths (227 in, 194 out; lognormal, sigma 1): the sources do not list per-request lengths. "
       "'random' workloads draw lengths as bench_serving does: uniform in [max(1, L x range_ratio), L]; with a seed, "
       "exactly its draws, and the run is simulated whole, after bench_serving's warm-up request. A point of a series "
       "is run 'run' of the runs 'series' names (below), sent to one server one after another: each run finds the "
       "earlier runs' prompts in the prefix cache. Other closed loops are scored in steady state (after c warm-up "
       "requests).",
       "collected": "2026-12-02", "series": {"sgl-cookbook-70b-a100x8": cook_runs}, "points": pts}
json.dump(doc, open("kvserve/sim/data/validation.json", "w"), indent=1)
print(len(pts), sum(p["use"] for p in pts))
