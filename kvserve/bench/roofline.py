"""``kvserve bench roofline``: what this machine allows for the served model.

Owns three measurements and the arithmetic on them. The GEMM rate at the model's own linear shapes
(fused qkv, o_proj, gate_up, down, LM head) for a few row counts M, through the engine's kernel in the
weight format ``--quantization`` gives each linear (``QuantLinear`` for Q8_0/Q4_1, ``PackedLinear``
where ``cpu_packing_supported``, else ``F.linear``); the memory read bandwidth
(summing a tensor much larger than the last-level cache); and the ceilings they give: batch-1 decode
bound by bytes read per token, a batch of N decodes bound by its GEMMs (or its bytes, the larger).
With ``--offline-json`` it says what fraction of each ceiling a ``bench offline`` run reached.
The arithmetic (``linear_shapes`` .. ``ceilings``, ``achieved``) is pure; the timing is
``bench/gemm_timing.py``'s.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

from kvserve.config import KVServeConfig
from kvserve.kv.layout import ELEMENT_BYTES, KVLayout
from kvserve.model.config import ModelConfig

DEFAULT_ROWS = (1, 8, 64)
SMALL_BUDGET = 512  # the step's token budget joins the row counts when at most this


@dataclass(frozen=True)
class LinearShape:
    name: str
    k: int  # input features
    n: int  # output features
    count: int  # how many of it one forward runs (layers, or 1 for the LM head)
    bias: bool = False


def linear_shapes(cfg: ModelConfig) -> list[LinearShape]:
    """The GEMMs of one forward, as ``model/llama.py`` fuses them."""
    h, hd, layers = cfg.hidden_size, cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads, cfg.num_hidden_layers
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    return [
        LinearShape("qkv", h, q + 2 * kv, layers, cfg.attention_bias),
        LinearShape("o_proj", q, h, layers),
        LinearShape("gate_up", h, 2 * cfg.intermediate_size, layers),
        LinearShape("down", cfg.intermediate_size, h, layers),
        LinearShape("lm_head", h, cfg.vocab_size, 1),
    ]


def forward_flops(shapes: list[LinearShape], m: int) -> float:
    """2*M*K*N per linear, all linears of one forward of M rows summed."""
    return sum(2.0 * m * s.k * s.n * s.count for s in shapes)


# bytes per weight of the quantized formats (kvserve/model/quant.py): 32 values + fp16 scale (and min)
FORMAT_BYTES = {"q8_0": 34 / 32, "q4_1": 20 / 32, "q4_0": 18 / 32, "bf16": 2}


def weight_bytes(cfg: ModelConfig, dtype: str, formats: dict[str, str | None] | None = None) -> int:
    """Bytes of the weights one decode step reads: every linear (LM head included; a tied head reads the
    embedding) in its format (``formats``: linear name -> q8_0/q4_1, absent or None: ``dtype``) and the
    norms in ``dtype``. The embedding lookup reads one row per token: left out."""
    formats = formats or {}
    linear = sum(s.k * s.n * s.count * FORMAT_BYTES.get(formats.get(s.name) or "", ELEMENT_BYTES[dtype])
                 for s in linear_shapes(cfg))
    return int(linear + (2 * cfg.num_hidden_layers + 1) * cfg.hidden_size * ELEMENT_BYTES[dtype])


def batch_weight_bytes(cfg: ModelConfig, dtype: str, formats: dict[str, str | None], rows: int,
                       amx: bool | None = None) -> int | None:
    """What a step of ``rows`` rows reads for its weights where that differs from ``weight_bytes``: on
    an AMX CPU, quantized linears take AMX_MIN_ROWS rows or more in their bf16 copies; else None."""
    from kvserve.device import amx_gemm_available
    from kvserve.kernels import kernels_available
    from kvserve.model.quant_linear import AMX_MIN_ROWS

    amx = (amx_gemm_available() and kernels_available()) if amx is None else amx
    if not (amx and rows >= AMX_MIN_ROWS and any(formats.values())):
        return None
    return weight_bytes(cfg, dtype, {n: "bf16" if f else None for n, f in formats.items()})


_GGUF_TENSOR = {"qkv": "blk.0.attn_q.weight", "o_proj": "blk.0.attn_output.weight", "gate_up": "blk.0.ffn_gate.weight",
                "down": "blk.0.ffn_down.weight"}
_GGUF_FORMAT = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1", "Q4_K": "q4_1"}


def weight_formats(quantization: str, model_path: str) -> dict[str, str | None]:
    """Linear name -> the format the engine runs it in (None: dense), as ``--quantization`` decides."""
    names = ("qkv", "o_proj", "gate_up", "down", "lm_head")
    if quantization == "int8":
        return dict.fromkeys(names, "q8_0")
    gguf_file = str(model_path).endswith(".gguf")
    if quantization == "int4":  # a GGUF's Q4_0 linears keep their format (quant_linear._group)
        stored = _gguf_formats(model_path) if gguf_file else {}
        return {**{n: "q4_0" if stored.get(n) == "q4_0" else "q4_1" for n in names}, "lm_head": "q8_0"}
    if quantization != "auto" or not gguf_file:
        return dict.fromkeys(names)
    return _gguf_formats(model_path)


def _gguf_formats(model_path: str) -> dict[str, str | None]:
    """Linear name -> the format a GGUF file stores it in, as the engine keeps it (None: dense)."""
    import gguf

    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(model_path).tensors}
    head = types.get("output.weight", types.get("token_embd.weight", ""))
    return {**{n: _GGUF_FORMAT.get(types.get(t, "")) for n, t in _GGUF_TENSOR.items()}, "lm_head": _GGUF_FORMAT.get(head)}


def kv_layout(cfg: ModelConfig, dtype: str, block_size: int = 16) -> KVLayout:
    shapes = cfg.kv_layer_shapes()
    return KVLayout(cfg.kv_cache_layers, cfg.num_key_value_heads, cfg.head_dim or 0, block_size, dtype,
                    None if shapes is None else tuple(shapes))


def gemm_rate(shapes: list[LinearShape], m: int, seconds_per_call: dict[str, float]) -> float:
    """GFLOP/s of a whole forward's GEMMs at M rows from each linear's measured time per call."""
    total = sum(seconds_per_call[s.name] * s.count for s in shapes)
    return forward_flops(shapes, m) / total / 1e9


def ceilings(cfg: ModelConfig, dtype: str, bandwidth_gbs: float, gflops_at_batch: float, batch: int,
             context_len: int, kv_dtype: str | None = None, formats: dict[str, str | None] | None = None,
             batch_weight_bytes: int | None = None) -> dict[str, Any]:
    """The decode ceilings: batch 1 (bytes read per token / bandwidth) and a batch of ``batch``
    decodes (max of GEMM time and bytes time per step), each sequence ``context_len`` tokens deep.
    ``batch_weight_bytes``: what the batch's linears read, where not the batch-1 formats (the bf16
    copies quantized linears take for many rows on an AMX CPU)."""
    w = weight_bytes(cfg, dtype, formats)
    w_batch = w if batch_weight_bytes is None else batch_weight_bytes
    kv_token = kv_layout(cfg, kv_dtype or dtype).bytes_per_token * context_len  # one sequence's KV read
    b1_s = (w + kv_token) / (bandwidth_gbs * 1e9)
    gemm_s = forward_flops(linear_shapes(cfg), batch) / (gflops_at_batch * 1e9)
    bytes_s = (w_batch + batch * kv_token) / (bandwidth_gbs * 1e9)
    step_s = max(gemm_s, bytes_s)
    return {
        "weight_bytes": w,
        "batch_weight_bytes": w_batch,
        "kv_bytes_per_sequence": kv_token,
        "context_len": context_len,
        "batch1": {"bytes_per_token": w + kv_token, "min_ms_per_token": b1_s * 1e3, "max_tokens_per_s": 1 / b1_s},
        "batch": {"n": batch, "flops_per_step": forward_flops(linear_shapes(cfg), batch),
                  "gemm_ms": gemm_s * 1e3, "bytes_ms": bytes_s * 1e3, "min_step_ms": step_s * 1e3,
                  "bound": "compute" if gemm_s >= bytes_s else "memory", "max_tokens_per_s": batch / step_s},
    }


def achieved(offline: dict[str, Any], gemm_step_ms: float, ceiling_tokens_per_s: float) -> dict[str, Any]:
    """What fraction of the ceilings a ``bench offline`` result reached (1.0: the ceiling itself)."""
    p50 = offline.get("decode_step_ms_p50")
    tps = offline.get("output_tokens_per_s")
    return {
        "decode_step_ms_p50": p50,
        "gemm_only_step_ms": gemm_step_ms,
        "step_fraction": gemm_step_ms / p50 if p50 else None,  # GEMM-only time / measured step
        "output_tokens_per_s": tps,
        "ceiling_tokens_per_s": ceiling_tokens_per_s,
        "tokens_fraction": tps / ceiling_tokens_per_s if tps else None,
    }


def row_counts(batch: int, token_budget: int, extra: list[int] | None = None) -> list[int]:
    rows = set(DEFAULT_ROWS) | {batch} | set(extra or [])
    if token_budget <= SMALL_BUDGET:
        rows.add(token_budget)
    return sorted(r for r in rows if r >= 1)


# ---- the command ----

def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", type=int, default=64, help="decodes per step for the batch ceiling")
    p.add_argument("--context-len", type=int, default=None, help="tokens of KV each decode reads "
                   "(default: 1024, or input_len + output_len/2 of --offline-json)")
    p.add_argument("--rows", type=int, nargs="+", default=None, help="extra row counts M to time the GEMMs at")
    p.add_argument("--repeats", type=int, default=3, help="repetitions of each timing (their median is kept)")
    p.add_argument("--min-time-ms", type=float, default=50.0, help="each GEMM timing repetition runs this long")
    p.add_argument("--bandwidth-mib", type=int, default=512, help="size of the tensor read for the bandwidth")
    p.add_argument("--offline-json", default=None, help="a `bench offline --output-json` result to compare")
    p.add_argument("--output-json", default=None, help="also write the figures to this file")
    p.add_argument("--measure-step", action="store_true", help="also run --batch sequences of --step-prompt-len "
                   "tokens and split their decode steps into GEMMs, attention, sampling and the rest")
    p.add_argument("--step-prompt-len", type=int, default=128, help="prompt tokens of each --measure-step sequence")
    p.add_argument("--step-output-len", type=int, default=32, help="output tokens of each --measure-step sequence")
    KVServeConfig.add_cli_args(p)


def _model_and_dtype(args: argparse.Namespace, offline: dict[str, Any] | None) -> tuple[ModelConfig, Any, str]:
    import torch

    from kvserve.device import resolve_device, resolve_dtype
    from kvserve.errors import InvalidArgumentError
    from kvserve.kernels import kernels_available
    from kvserve.model.loader import load_model_config, resolve_model_path

    cfg = KVServeConfig.from_cli_args(args)
    if cfg.model.num_threads:
        torch.set_num_threads(cfg.model.num_threads)
    device = resolve_device(cfg.model.device)
    if device != "cpu":
        raise InvalidArgumentError("bench roofline measures the CPU only (--device cpu)", param="device")
    dtype_name = cfg.model.dtype
    if dtype_name == "auto" and offline and offline.get("dtype") in ELEMENT_BYTES:
        dtype_name = offline["dtype"]  # compare against the run in the precision it ran
    path = str(resolve_model_path(cfg.model.model))
    quantized = any(weight_formats(cfg.model.quantization, path).values()) and kernels_available()
    dtype = resolve_dtype(dtype_name, device, quantized=quantized)
    from kvserve.attention.kv_pool import get_kv_pool, resolve_kv_cache_dtype
    from kvserve.device import amx_gemm_available

    kv_name = resolve_kv_cache_dtype(cfg.cache.kv_cache_dtype, dtype, quantized and amx_gemm_available())
    kv_dtype = str(get_kv_pool(kv_name).storage_dtype(dtype)).removeprefix("torch.")
    return load_model_config(path), dtype, kv_dtype


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from kvserve.errors import InvalidArgumentError

    for name in ("batch", "repeats", "bandwidth_mib"):
        if getattr(args, name) < 1:
            raise InvalidArgumentError(f"--{name.replace('_', '-')} must be at least 1")
    offline = None
    if args.offline_json:
        try:
            with open(args.offline_json) as f:
                offline = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise InvalidArgumentError(f"cannot read --offline-json {args.offline_json}: {e}") from e
    model, dtype, kv_dtype = _model_and_dtype(args, offline)
    dtype_name = str(dtype).replace("torch.", "")
    budget = KVServeConfig.from_cli_args(args).scheduler.max_num_batched_tokens
    max_seqs = KVServeConfig.from_cli_args(args).scheduler.max_num_seqs
    offline_batch = min(int(offline["num_prompts"]), max_seqs) if offline and offline.get("num_prompts") else None
    context = args.context_len
    if context is None:
        context = (int(offline["input_len"] + offline["output_len"] / 2)
                   if offline and offline.get("input_len") and offline.get("output_len") else 1024)
    rows = row_counts(args.batch, budget, (args.rows or []) + ([offline_batch] if offline_batch else []))

    from kvserve.model.layers import cpu_packing_supported

    from kvserve.model.loader import resolve_model_path

    engine_cfg = KVServeConfig.from_cli_args(args)
    formats = weight_formats(engine_cfg.model.quantization, str(resolve_model_path(engine_cfg.model.model)))
    dense = "PackedLinear (oneDNN)" if cpu_packing_supported(dtype) else "F.linear"
    kernel = ", ".join(f"{n} {f or dense}" for n, f in formats.items()) if any(formats.values()) else dense
    shapes = linear_shapes(model)
    print(f"model: {model.num_hidden_layers} layers, hidden {model.hidden_size}, vocab {model.vocab_size}   "
          f"dtype: {dtype_name}   kernel: {kernel}   threads: {torch.get_num_threads()}")
    print("linears (K x N): " + ", ".join(f"{s.name} {s.k}x{s.n}" + (f" x{s.count}" if s.count > 1 else "")
                                          for s in shapes))
    from kvserve.bench.gemm_timing import measure_bandwidth, measure_gemms

    bw, how = measure_bandwidth(args.bandwidth_mib, max(args.repeats, 3))
    print(f"memory read bandwidth: {bw:.1f} GB/s ({args.bandwidth_mib} MiB {how})")
    times = measure_gemms(shapes, model.num_hidden_layers, dtype, rows, args.repeats, args.min_time_ms / 1e3,
                          formats=formats)
    rates = {m: gemm_rate(shapes, m, times[m]) for m in rows}
    print("GEMM rate, all linears of one forward:")
    for m in rows:
        per = "  ".join(f"{s.name} {2 * m * s.k * s.n / times[m][s.name] / 1e9:.1f}" for s in shapes)
        print(f"  M={m:<5} {rates[m]:8.1f} GFLOP/s   forward GEMMs {forward_flops(shapes, m) / rates[m] / 1e6:8.2f} ms"
              f"   ({per})")

    ceil = ceilings(model, dtype_name, bw, rates[args.batch], args.batch, context, kv_dtype, formats,
                    batch_weight_bytes(model, dtype_name, formats, args.batch))
    b1, bn = ceil["batch1"], ceil["batch"]
    at_batch = (f"; {ceil['batch_weight_bytes'] / 2**20:.1f} MiB at batch {args.batch}: bf16 copies"
                if ceil["batch_weight_bytes"] != ceil["weight_bytes"] else "")
    print(f"ceilings at context {context} (weights {ceil['weight_bytes'] / 2**20:.1f} MiB{at_batch}, "
          f"KV {ceil['kv_bytes_per_sequence'] / 2**20:.2f} MiB per sequence, {kv_dtype}):")
    print(f"  batch 1 decode: >= {b1['min_ms_per_token']:.2f} ms/token, <= {b1['max_tokens_per_s']:.1f} tokens/s "
          f"(memory bound)")
    print(f"  batch {args.batch} decode: >= {bn['min_step_ms']:.2f} ms/step (GEMMs {bn['gemm_ms']:.2f} ms, "
          f"bytes {bn['bytes_ms']:.2f} ms: {bn['bound']} bound), <= {bn['max_tokens_per_s']:.1f} tokens/s")
    result: dict[str, Any] = {
        "model": {"layers": model.num_hidden_layers, "hidden": model.hidden_size,
                  "intermediate": model.intermediate_size, "vocab": model.vocab_size},
        "dtype": dtype_name, "kv_dtype": kv_dtype, "kernel": kernel, "weight_formats": formats, "threads": torch.get_num_threads(),
        "linears": [{"name": s.name, "k": s.k, "n": s.n, "count": s.count} for s in shapes],
        "bandwidth_gbs": bw,
        "gemm": {str(m): {"gflops": rates[m], "forward_gemm_ms": forward_flops(shapes, m) / rates[m] / 1e6,
                          "us_per_call": {k: v * 1e6 for k, v in times[m].items()}} for m in rows},
        "ceilings": ceil,
    }
    if offline is not None and offline_batch:
        gemm_ms = forward_flops(shapes, offline_batch) / rates[offline_batch] / 1e6
        at = ceilings(model, dtype_name, bw, rates[offline_batch], offline_batch, context, kv_dtype, formats,
                      batch_weight_bytes(model, dtype_name, formats, offline_batch))
        result["offline"] = achieved(offline, gemm_ms, at["batch"]["max_tokens_per_s"])
        result["offline"]["batch"] = offline_batch
        o = result["offline"]
        print(f"offline run ({args.offline_json}, {offline_batch} decodes per step, dtype {offline.get('dtype')}):")
        if o["step_fraction"] is not None:
            print(f"  decode step p50 {o['decode_step_ms_p50']} ms vs GEMM-only {gemm_ms:.2f} ms: "
                  f"{100 * o['step_fraction']:.0f}% of the step is GEMM time at the measured rate")
        if o["tokens_fraction"] is not None:
            print(f"  output {o['output_tokens_per_s']} tokens/s vs ceiling {o['ceiling_tokens_per_s']:.1f}: "
                  f"{100 * o['tokens_fraction']:.0f}% (prefill steps included in the run's figure)")
    if args.measure_step:
        result["step_split"] = _measure_step(args, shapes, rates[args.batch])
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return result


def _measure_step(args: argparse.Namespace, shapes: list[LinearShape], gflops: float) -> dict[str, Any]:
    from kvserve.bench.step_split import measure_step_split

    kwargs = KVServeConfig.from_cli_args(args).to_kwargs()
    kwargs["max_num_seqs"] = max(kwargs.get("max_num_seqs") or 0, args.batch)
    split = measure_step_split(kwargs, args.batch, args.step_prompt_len, args.step_output_len)
    if not split["steps"]:
        print(f"live decode step: no step ran {args.batch} decodes together (raise --max-num-seqs?)")
        return split
    ms = split["ms_p50"]
    gemm_only = forward_flops(shapes, args.batch) / gflops / 1e6
    split["gemm_only_ms"] = gemm_only
    split["step_over_gemm_only"] = ms["total"] / gemm_only
    shown = [p for p in ("gemm", "attention", "native_layers", "sampling", "head_draw", "rest")
             if ms[p] > 0 or p not in ("native_layers", "head_draw")]  # those two only where they ran
    parts = "  ".join(f"{p} {ms[p]:.1f} ({100 * ms[p] / ms['total']:.0f}%)" for p in shown)
    print(f"live decode step, {args.batch} sequences of {args.step_prompt_len}+ tokens, p50 of {split['steps']} steps: "
          f"{ms['total']:.1f} ms = {split['step_over_gemm_only']:.2f}x GEMM-only {gemm_only:.1f} ms")
    print(f"  {parts}")
    return split
