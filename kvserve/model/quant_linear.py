"""Layers over quantized weights (``QuantLinear``, ``QuantEmbedding``) and which layers get them.

``quantized_modules`` decides, from the ``--quantization`` mode and the loaded weights, which of the
decoder's linear layers (q/k/v and gate/up fused, as ``CausalLM`` fuses them: ``kvserve.model.weights``), the LM
head and the embedding table are built over a ``QuantWeight``; every other weight is loaded dense.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.device import amx_gemm_available
from kvserve.kernels import kernels_available, ops
from kvserve.model.config import ModelConfig
from kvserve.model.layers import PackedLinear
from kvserve.model.quant import BLOCK, QuantExperts, QuantWeight, quantize
from kvserve.model.weights import linear_sources

log = logging.getLogger(__name__)

QUANTIZATION_MODES = ("auto", "none", "int8", "int4")
# the format each mode converts weights to; auto keeps a GGUF's as stored and leaves dense ones dense
_TARGET = {"int8": "q8_0", "int4": "q4_1"}
# Prefill-sized inputs take the integer-dot kernel too: with the weights packed it
# beats dequantizing them and running MKL's fp32 GEMM at every row count measured, 64 to 1,024 rows
# (~1.25-1.35x at 512-1,024 rows on an AVX2 EPYC: docs/benchmarks.md), and every row
# gets the same arithmetic however the step's rows are batched or chunked.
# Except on a CPU with AMX (Sapphire Rapids and later): there oneDNN's bf16 GEMM over a prepacked
# copy of the weight beats the integer kernel from ~16 rows (2x at 64 rows, 3-8x for the LM head;
# docs/benchmarks.md), so inputs of at least AMX_MIN_ROWS rows take it, converted to
# bf16 and back. Fewer rows (a small decode batch) stay on the integer kernel, which reads 3.5x
# fewer bytes. The cost: a bf16 copy of each weight, and results that depend on whether a step
# had AMX_MIN_ROWS rows. KVSERVE_AMX=0 turns it off.
# A decoder layer's linear (``tiles=True``) also gets a copy packed for kvserve's own AMX kernel
# (kernels/csrc/gemm/amx_gemm.cpp), which takes inputs of AMX_MIN_ROWS to ``amx_linear_max_rows()`` (96)
# rows: at 64 rows it reads weights from memory ~15-25% faster than oneDNN, and from the cache
# 1.2-2x faster (scripts/amx_linear_bench.py; docs/benchmarks.md). oneDNN stays faster
# for more rows and for the LM head's wide output. The cost: a second bf16 copy of those weights.
# The LM head (``head=True``) gets a tile copy too, for one use: a step whose rows all draw greedily or
# with plain temperature draws inside the head (``draw``, kernels/csrc/sampling/amx_head.cpp), with no logits
# written. Against oneDNN's head and the native argmax / draw (scripts/amx_head_bench.py, cold weights;
# the runner's sampler adds ~0.35 ms of Python to the latter): greedy 2.60 vs 3.00 ms at 32 rows, 3.63
# vs 3.29 at 64, 4.87 vs 3.95 at 128; sampled 2.90 vs 3.42 at 32 rows, 4.03 vs 3.96 at 64, 6.40 vs 5.58
# at 128. Past 64 rows the tile GEMM's own products (slower than oneDNN's there) and, for sampled rows,
# exps interleaved with them cost more than the Python saved (docs/benchmarks.md).
AMX_MIN_ROWS = 16
HEAD_DRAW_MAX_ROWS = 64


class QuantLinear(nn.Module):
    """y = x @ W^T (+ bias) with W kept quantized, through the ``kvserve`` native kernels.

    The kernels read a packed copy of the weight (``ops.pack_quant``: tiles of 8
    output columns, each a sequential stream with its scales inline), made here; the QuantWeight
    itself is not kept. Without the kernels (no compiler, KVSERVE_KERNELS=0) the weight is
    dequantized once to the model's dtype and an ordinary GEMM runs: the same weights, slower and
    bigger.
    """

    def __init__(self, weight: QuantWeight, bias: torch.Tensor | None, dtype: torch.dtype,
                 use_kernels: bool | None = None, amx: bool | None = None, tiles: bool = False, head: bool = False):
        super().__init__()
        self.kind = weight.kind
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.detach().to(dtype)
        self.use_kernels = kernels_available() if use_kernels is None else use_kernels
        # plain attributes, not buffers: ``Module.to(dtype)`` must not cast them
        self.packed: torch.Tensor | None = None
        self.dense: torch.Tensor | None = None
        self.amx: PackedLinear | None = None  # the bf16 copy for inputs of AMX_MIN_ROWS rows or more
        self.tiles: torch.Tensor | None = None  # the bf16 copy for amx_linear (up to tile_rows rows)
        self.tile_rows = 0
        self.draw_tiles: torch.Tensor | None = None  # the LM head's bf16 copy for amx_head_sample
        if self.use_kernels:
            self.packed = ops.pack_quant(weight.qs, weight.d, weight.m)
            if amx_gemm_available() if amx is None else amx:
                bf16 = weight.dequantize(torch.bfloat16)
                self.amx = PackedLinear(bf16, None)
                if (tiles or head) and ops.amx_gemm_available():
                    if head:
                        self.draw_tiles = ops.amx_pack(bf16)
                    else:
                        self.tiles = ops.amx_pack(bf16)
                        self.tile_rows = ops.amx_linear_max_rows()
        else:
            self.dense = weight.dequantize(dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [N, K] as ``dtype``."""
        if self.dense is not None:
            return self.dense.to(dtype)
        return ops.dequantize_packed(self.packed, self.kind, self.out_features, self.in_features).to(dtype)

    def runs_amx(self, x: torch.Tensor) -> bool:
        """Whether ``x`` goes through the bf16 AMX copy (AMX_MIN_ROWS rows or more; not once a dense
        weight has been set, which ``forward`` takes first)."""
        return self.dense is None and self.amx is not None and x.numel() >= AMX_MIN_ROWS * self.in_features

    def draws(self, x: torch.Tensor) -> bool:
        """Whether ``draw`` takes these rows: an LM head with its tile copy, rows that would run on the
        bf16 AMX copy anyway (AMX_MIN_ROWS or more, so a draw sees the logits' bf16 rounding either
        way), and no more than HEAD_DRAW_MAX_ROWS."""
        return self.draw_tiles is not None and self.runs_amx(x) and x.shape[0] <= HEAD_DRAW_MAX_ROWS

    def draw(self, x: torch.Tensor, inv_temp: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """This LM head's token per row of ``x`` [rows, in] without writing the logits: greedy where
        ``inv_temp`` is 0, else drawn from softmax(logits * inv_temp) with the row's U[0, 1) number
        ``u``, as ``sample_rows`` would over the bf16 logits (where ``draws`` holds)."""
        assert self.draw_tiles is not None
        return ops.amx_head_sample(x.to(torch.bfloat16).contiguous(), self.draw_tiles, self.out_features, inv_temp, u)

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """``out_dtype`` (default: x's) is honoured on the AMX path only, where a bf16 output saves
        the next bf16 consumer a conversion (``SwiGLU``)."""
        if self.dense is not None:
            return F.linear(x, self.dense, self.bias)
        if self.runs_amx(x):
            flat = x.reshape(-1, self.in_features)
            if flat.shape[0] <= self.tile_rows:  # the tile copy (a decode step's rows)
                y = ops.amx_linear(flat.to(torch.bfloat16), self.tiles, self.out_features)
            else:
                y = self.amx(flat, dtype=torch.bfloat16)
            y = y.to(out_dtype or x.dtype)
            if self.bias is not None:
                y += self.bias
            return y.view(*x.shape[:-1], self.out_features)
        if x.dim() == 2 and x.dtype == torch.float32 and self.bias is None:
            # the decoder's case, with as few torch calls as possible (a decode step makes ~120 of these)
            return ops.packed_linear(x, self.packed, self.kind, self.out_features)
        flat = x.reshape(-1, self.in_features).float()
        y = ops.packed_linear(flat, self.packed, self.kind, self.out_features)
        if self.bias is not None:
            y += self.bias
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"{self.in_features}, {self.out_features}, {self.kind}, kernels={self.use_kernels}, "
                f"amx={self.amx is not None}, tiles={self.tiles is not None}, draw_tiles={self.draw_tiles is not None}")


class QuantEmbedding(nn.Module):
    """An embedding table kept quantized: a lookup dequantizes only the rows it gathers."""

    def __init__(self, weight: QuantWeight, dtype: torch.dtype):
        super().__init__()
        self.weight_q = weight
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight_q.rows(ids.reshape(-1)).dequantize(self.dtype).view(*ids.shape, -1)


def runs_quantized(mode: str, weights: dict[str, Any]) -> bool:
    """Whether the linear layers will run on the integer kernels (on a CPU): a quantizing mode, or
    ``auto`` over weights stored quantized, and the kernels built."""
    stored = mode == "auto" and any(isinstance(w, (QuantWeight, QuantExperts)) for w in weights.values())
    return (mode in _TARGET or stored) and kernels_available()


def quantized_modules(cfg: ModelConfig, weights: dict[str, Any], mode: str, device: torch.device,
                      release: Callable[[str], None] | None = None) -> dict[str, QuantWeight]:
    """Module path -> the QuantWeight it is built over (empty: everything dense, as ``none``).

    ``auto`` keeps the weights a GGUF file stores quantized (an all-quantized group, same format), and
    MXFP4 experts as the q8_0 they loaded as (exact);
    ``int8``/``int4`` quantize every linear weight at load (Q8_0 / Q4_1; a weight already in that format
    is kept as is, and under int4 a Q4_0 group too; under int4 MXFP4 experts' q8_0 is requantized to Q4_1, lossy, 5 bits a weight). The LM
    head is Q8_0 under int4 too: the logits are the most sensitive GEMM, and only decode's single row pays for its bytes. Only CPUs run the kernels:
    on other devices every weight is dequantized to the model's dtype. ``release(name)`` is called for
    each checkpoint tensor once every layer that reads it is quantized (the embedding's never).
    """
    if mode not in QUANTIZATION_MODES:
        raise ValueError(f"unknown quantization {mode!r} (one of {', '.join(QUANTIZATION_MODES)})")
    if mode == "none":
        return {}
    if device.type != "cpu":
        if mode != "auto" or any(isinstance(w, QuantWeight) for w in weights.values()):
            log.info("quantization %s: quantized kernels are CPU-only; weights dequantized on %s", mode, device)
        return {}
    groups = linear_sources(cfg)
    head = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"
    groups["lm_head"] = [head]
    users: dict[str, list[str]] = {}
    for path, names in groups.items():
        for name in names:
            users.setdefault(name, []).append(path)
    out: dict[str, QuantWeight] = {}
    for path, names in groups.items():
        kind = "q8_0" if path == "lm_head" and mode != "auto" else _TARGET.get(mode)
        qw = _group(path, [weights[n] for n in names], kind)
        if qw is not None:
            out[path] = qw
            for name in names:
                if release is not None and name != "model.embed_tokens.weight" and all(p in out for p in users[name]):
                    release(name)
    embed = weights["model.embed_tokens.weight"]
    if isinstance(embed, QuantWeight):  # stored quantized: a lookup dequantizes its rows
        out["embed_tokens"] = embed
    return out


def _group(path: str, parts: list[Any], kind: str | None) -> QuantWeight | None:
    """The fused QuantWeight of ``parts`` in format ``kind`` (None: as stored), or None for dense."""
    k = parts[0].shape[1]
    if k % BLOCK:
        log.info("%s: %d input features are not a multiple of %d; kept dense", path, k, BLOCK)
        return None
    if kind is None:
        if not all(isinstance(p, QuantWeight) for p in parts):
            return None
        if {p.kind for p in parts} == {"q4_0", "q4_1"}:  # fused as q4_1, exactly
            parts = [p.as_q4_1() if p.kind == "q4_0" else p for p in parts]
        if len({p.kind for p in parts}) != 1:
            return None
        return QuantWeight.cat(parts) if len(parts) > 1 else parts[0]
    if kind == "q4_1" and all(isinstance(p, QuantWeight) and p.kind == "q4_0" for p in parts):
        kind = "q4_0"  # already 4-bit, in fewer bytes
    converted = []
    for p in parts:
        if isinstance(p, QuantWeight):
            if p.kind == "q4_0" and kind == "q4_1":
                p = p.as_q4_1()
            p = p if p.kind == kind else quantize(p.dequantize(), kind)
        else:
            p = quantize(p, kind)
        converted.append(p)
    return QuantWeight.cat(converted) if len(converted) > 1 else converted[0]
