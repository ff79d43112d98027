"""Per-engine cost terms: what makes vLLM, SGLang and TensorRT-LLM take different times for the
same batch on the same GPU, each term named and sourced.

The scheduler is the same for every profile; these terms only change what a step *costs*:

- host time per step (scheduling, output processing, detokenizing) and whether the engine overlaps
  it with the GPU's work on the previous step;
- CUDA graphs: a decode-only step whose batch fits a captured size replays one graph (padded up to
  that size); any other step launches its kernels one by one;
- GEMM efficiency by token count: a GEMM over few rows cannot reach the large-batch MFU;
- attention efficiency by the KV a step reads: short contexts and small batches leave SMs idle;
- prefill/decode interference: a step that mixes both does not fully overlap its compute-bound and
  memory-bound halves.

The ``fitted`` terms (``gemm_scale``, ``bandwidth_scale``, ``host_step_s``, ``host_per_seq_s``,
``allreduce_s``; ``ENGINE_FITTED_FIELDS`` may add terms per engine) are multipliers and times fitted to published measurements by ``kvserve sim validate --fit`` (see
``kvserve/sim/validate.py`` and ``kvserve/sim/data/fitted_terms.json``); the rest come from the
engines' documented defaults.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, fields, replace
from importlib import resources

# vLLM V1 captures [1, 2, 4] + multiples of 8 up to 512 (CompilationConfig.cudagraph_capture_sizes):
# https://docs.vllm.ai/en/latest/api/vllm/config/compilation.html
VLLM_GRAPH_SIZES = (1, 2, 4, *range(8, 513, 8))
# SGLang: 1..4, then multiples of 8 up to cuda_graph_max_bs, 256 on an 80 GB GPU below TP 4:
# https://github.com/sgl-project/sglang/blob/main/python/sglang/srt/server_args.py
SGLANG_GRAPH_SIZES = (1, 2, 3, 4, *range(8, 257, 8))
# TensorRT-LLM's published benchmark config (cuda_graph_config.batch_sizes, enable_padding):
# https://github.com/NVIDIA/TensorRT-LLM/blob/main/docs/source/performance/perf-overview.md
TRTLLM_GRAPH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 384, 512, 1024, 2048, 4096, 8192)


@dataclass(frozen=True)
class EngineCosts:
    # -- host (CPU) side, per step
    host_step_s: float = 0.004  # scheduling + output processing per step (fitted)
    host_per_seq_s: float = 20e-6  # the same per running sequence: sampling, output processing (fitted)
    overlap_host: bool = False  # the host prepares step n+1 while the GPU runs step n
    # ... and so a request sent during step n joins step n+2 at the earliest (SGLang's overlap event loop)
    late_admission: bool = False
    # the front end (HTTP, tokenizing, handing the request to the scheduler) takes one request at a
    # time: a burst reaches the scheduler spread out by this much per request and per prompt token
    frontend_per_request_s: float = 0.0
    frontend_per_token_s: float = 0.0
    # -- kernel launches
    graph_sizes: tuple[int, ...] = ()  # decode batch sizes with a captured CUDA graph
    launch_graph_s: float = 50e-6  # GPU-side cost of replaying one captured graph
    launch_eager_per_layer_s: float = 40e-6  # launching a layer's kernels one by one
    # -- GEMMs: mfu(tokens) = hardware mfu * gemm_scale * tokens / (tokens + gemm_half_tokens)
    gemm_scale: float = 1.0  # (fitted)
    gemm_half_tokens: float = 128.0
    # -- memory: weights at hardware mbu * bandwidth_scale; KV reads also at
    #    kv_tokens / (kv_tokens + attn_half_kv_tokens) of that (small batches of short contexts do worse)
    bandwidth_scale: float = 1.0  # (fitted)
    attn_half_kv_tokens: float = 4096.0
    # -- tensor parallelism: each of a layer's two all-reduces costs this latency plus its bytes on the link
    allreduce_s: float = 20e-6  # (fitted)
    # -- a mixed prefill+decode step overlaps its compute and memory halves only partly
    interference: float = 0.3  # fraction of the shorter half that is not hidden
    source: str = ""

    def graph_batch(self, batch: int) -> int | None:
        """The captured size a decode batch of ``batch`` sequences pads up to (None: runs eagerly)."""
        i = bisect.bisect_left(self.graph_sizes, batch)
        return self.graph_sizes[i] if i < len(self.graph_sizes) else None

    def gemm_efficiency(self, tokens: int) -> float:
        return self.gemm_scale * tokens / (tokens + self.gemm_half_tokens)

    def kv_efficiency(self, kv_tokens: float) -> float:
        return self.bandwidth_scale * kv_tokens / (kv_tokens + self.attn_half_kv_tokens) if kv_tokens else 1.0

    def with_(self, **changes) -> "EngineCosts":
        return replace(self, **changes)


ENGINE_COSTS: dict[str, EngineCosts] = {
    # vLLM V1: the engine core runs in its own process and detokenizing happens in the API server, but
    # scheduling and input preparation sit between steps unless --async-scheduling is given:
    # https://blog.vllm.ai/2025/01/27/v1-alpha-release.html
    "vllm": EngineCosts(overlap_host=False, graph_sizes=VLLM_GRAPH_SIZES,
                        source="https://blog.vllm.ai/2025/01/27/v1-alpha-release.html"),
    # SGLang: the overlap scheduler (on by default since v0.4) runs the CPU's scheduling of the next
    # batch while the GPU computes the current one: https://lmsys.org/blog/2024-12-04-sglang-v0-4/
    # Its TokenizerManager (one process) parses, tokenizes and forwards each request in turn. The
    # catalog assumes ~1 ms a request and ~0.5 us a prompt token (a fast tokenizer's ~2M tokens/s); the
    # per-request time is then fitted (fitted_terms.json: 1.09 ms), the per-token one is not
    # (docs/simulator.md)
    "sglang": EngineCosts(overlap_host=True, late_admission=True, graph_sizes=SGLANG_GRAPH_SIZES,
                          frontend_per_request_s=1e-3, frontend_per_token_s=0.5e-6,
                          source="https://lmsys.org/blog/2024-12-04-sglang-v0-4/"),
    # TensorRT-LLM (PyTorch backend): overlap scheduler on by default, CUDA graphs with padding:
    # https://nvidia.github.io/TensorRT-LLM/features/overlap-scheduler.html. Its executor loop would
    # admit a step late too, but the online measurements we validate against (NIM 1.8) run the C++
    # executor, and their TTFTs fit without the lag (+49..90% with it): late_admission stays off
    # (docs/simulator.md)
    "trtllm": EngineCosts(overlap_host=True, graph_sizes=TRTLLM_GRAPH_SIZES, host_step_s=0.002,
                          source="https://nvidia.github.io/TensorRT-LLM/features/overlap-scheduler.html"),
    # kvserve itself on a GPU: Python scheduling between steps, no CUDA graphs
    "kvserve": EngineCosts(overlap_host=False, graph_sizes=(), host_step_s=0.006, source="this repository"),
    # llama.cpp: C++ host loop between steps, CUDA graphs for single-token batches only:
    # https://developer.nvidia.com/blog/optimizing-llama-cpp-ai-inference-with-cuda-graphs/
    "llamacpp": EngineCosts(overlap_host=False, graph_sizes=(1,), host_step_s=0.0005,
                            source="https://developer.nvidia.com/blog/optimizing-llama-cpp-ai-inference-with-cuda-graphs/"),
}
ENGINE_COSTS["static"] = ENGINE_COSTS["vllm"]
ENGINE_COSTS["trtllm-disagg"] = ENGINE_COSTS["trtllm"]

FITTED_FIELDS = ("gemm_scale", "bandwidth_scale", "host_step_s", "host_per_seq_s", "allreduce_s")
# Terms fitted for one engine only, where its published points determine them. SGLang's front-end time
# per request: its bursts (bench_serving's concurrency-capped starts) reach the scheduler
# spread out. Tried and rejected: SGLang's GEMM knee (gemm_half_tokens) refit with the
# rest went 128 -> 79 tokens and fixed its small-batch TPOTs (+31% -> +3%), but the held-back max rose
# 36% -> 46% (cookbook c=100 mean TTFT +46%): docs/simulator.md.
ENGINE_FITTED_FIELDS: dict[str, tuple[str, ...]] = {"sglang": (*FITTED_FIELDS, "frontend_per_request_s")}


def fitted_fields(engine: str) -> tuple[str, ...]:
    """The terms ``kvserve sim validate --fit`` fits for ``engine``."""
    return ENGINE_FITTED_FIELDS.get(engine, FITTED_FIELDS)


def load_fitted() -> dict[str, dict[str, float]]:
    """The fitted terms per engine (kvserve/sim/data/fitted_terms.json), {} where none were fitted."""
    try:
        text = resources.files("kvserve.sim").joinpath("data", "fitted_terms.json").read_text()
    except FileNotFoundError:
        return {}
    return {k: v for k, v in json.loads(text).get("engines", {}).items()}


def costs_for(engine: str, fitted: dict[str, dict[str, float]] | None = None) -> EngineCosts:
    """An engine's cost terms with its fitted values applied (the catalog's defaults where not fitted)."""
    base = ENGINE_COSTS.get(engine, ENGINE_COSTS["vllm"])
    fitted = load_fitted() if fitted is None else fitted
    known = {f.name for f in fields(EngineCosts)}
    return base.with_(**{k: v for k, v in fitted.get(engine, {}).items() if k in known})
