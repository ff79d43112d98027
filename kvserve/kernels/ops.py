"""The one way into the native CPU kernels: a typed wrapper per op, each with its fallback.

Every call the engine makes to ``torch.ops.kvserve`` or ``torch.classes.kvserve`` goes through here.
Where the kernels are loaded (``kvserve.kernels.load_kernels``) a wrapper calls its native op. Where
they are not (no compiler, a failed build, KVSERVE_KERNELS=0):

- the element-wise ops (``rms_norm``, ``add_rms_norm``, ``rotary_``, ``silu_mul``, ``gelu_tanh_mul``, ``store_rows_``,
  ``argmax_rows``, ``sample_rows``, the recurrent layers' decode steps ``delta_rule_step_`` and ``ssd_step_``) run torch
  code that computes what the kernel does, and the
  availability queries (``amx_gemm_available``, ``flash_prefill_available``) answer False;
- the rest (quantized GEMMs, ``amx_*``, the attention kernels, ``DecodeStack``, ``MoEBlock``) raise
  ``NativeKernelsUnavailable``: their callers already pick another path when the kernels are missing.

The element-wise wrappers take ``native``: False runs the torch code even with the kernels loaded (a
model whose layers were told not to use them, and the tests that compare the two).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kvserve.kernels.loader import load_kernels

_ops = torch.ops.kvserve  # resolved op by op at first use, once the library has registered them
# load_kernels()'s answer, kept here: the wrappers read it on every call (``_loaded or available()``:
# one global read once it is known, as most of these run many times a step)
_loaded: bool | None = None


class NativeKernelsUnavailable(RuntimeError):
    """A native op was called where the kernels are not loaded, and it has no torch fallback."""

    def __init__(self, op: str):
        super().__init__(f"kvserve native op {op!r} needs the native kernels, which are not loaded "
                         f"(see the 'native kernels' line logged at start-up; KVSERVE_KERNELS=0 turns them off)")
        self.op = op


def available() -> bool:
    """Whether the native kernels are loaded (the first call builds or loads them)."""
    global _loaded
    if _loaded is None:
        _loaded = load_kernels()
    return _loaded


def _require(op: str) -> None:
    if not available():
        raise NativeKernelsUnavailable(op)


# -- element-wise ops, with their torch fallbacks -----------------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None,
             out_rows: int = 0, *, native: bool = True) -> torch.Tensor:
    """RMSNorm of x's rows, as ``out_dtype`` (default x's), with ``out_rows`` rows where that is more
    than x's (zeros past them: a GEMM's padded input)."""
    if native and (_loaded or available()):
        return _ops.rms_norm(x, weight, eps, out_dtype, out_rows)
    # Normalise in float32 and cast back before the scale, exactly as the reference does.
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * h.to(x.dtype)
    y = y if out_dtype is None else y.to(out_dtype)
    return y if out_rows <= y.shape[0] else torch.cat([y, y.new_zeros(out_rows - y.shape[0], y.shape[1])])


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                 out_dtype: torch.dtype | None = None, out_rows: int = 0, *, native: bool = True) -> torch.Tensor:
    """residual += delta in place (delta may be bf16 on a float32 residual), then ``rms_norm`` of the sum."""
    if native and (_loaded or available()):
        return _ops.add_rms_norm(residual, delta, weight, eps, out_dtype, out_rows)
    residual.add_(delta)
    return rms_norm(residual, weight, eps, out_dtype, out_rows, native=False)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding of x [T, heads, dim] by tables broadcasting to it ([T, 1, dim])."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def rotary_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            *, native: bool = True) -> None:
    """Rotates q [T, heads, d] and k [T, kv_heads, d] in place (views into a fused projection's output
    are fine), at ``positions`` of the whole float32 tables ``cos``, ``sin`` [max_positions, d]."""
    if native and (_loaded or available()):
        _ops.rotary_(q, k, positions, cos, sin)
        return
    for x in (q, k):
        c, s = cos[positions].unsqueeze(1).to(x.dtype), sin[positions].unsqueeze(1).to(x.dtype)
        x.copy_(apply_rotary(x, c, s))


def silu_mul(gu: torch.Tensor, *, native: bool = True) -> torch.Tensor:
    """silu(gate) * up of a gate/up projection's output [..., 2 * I] (gate first)."""
    if native and (_loaded or available()):
        return _ops.silu_mul(gu)
    i = gu.shape[-1] // 2
    return F.silu(gu[..., :i]) * gu[..., i:]


def gelu_tanh_mul(gu: torch.Tensor, *, native: bool = True) -> torch.Tensor:
    """gelu_tanh(gate) * up of a gate/up projection's output [..., 2 * I] (gate first): Gemma's gated MLP."""
    if native and (_loaded or available()):
        return _ops.gelu_tanh_mul(gu)
    i = gu.shape[-1] // 2
    return F.gelu(gu[..., :i], approximate="tanh") * gu[..., i:]


def store_rows_(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, *, native: bool = True) -> None:
    """cache[slots] = x (x already in the cache's dtype): one row copy per token natively, which takes
    rows whose [heads, d] is contiguous (k or v of a fused projection); others go to ``index_copy_``."""
    if native and x.stride(-1) == 1 and x.stride(1) == x.shape[2] and (_loaded or available()):
        _ops.store_rows_(cache, slots, x)
    else:
        cache.index_copy_(0, slots, x)


def delta_rule_step_(states: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor, beta: torch.Tensor, decay: torch.Tensor, *, native: bool = True) -> torch.Tensor:
    """One gated-delta-rule step per sequence, its state ``states[slots[s]]`` [heads, dk, dv] updated in place (zeros
    first where ``fresh``): S = decay S + k (beta (v - decay S^T k))^T; returns S^T q [S, heads, dv]. q, k [S, heads, dk],
    v [S, heads, dv], beta and decay [S, heads]; all float32 (kvserve.model.gated_delta)."""
    if native and (_loaded or available()):
        return _ops.delta_rule_step_(states, slots, fresh, q.contiguous(), k.contiguous(), v.contiguous(),
                                     beta.contiguous(), decay.contiguous())
    state = states[slots].masked_fill(fresh[:, None, None, None], 0) * decay[..., None, None]
    recalled = torch.einsum("shkv,shk->shv", state, k)
    state = state + k[..., None] * (beta[..., None] * (v - recalled))[..., None, :]
    states[slots] = state
    return torch.einsum("shkv,shk->shv", state, q)


def ssd_step_(states: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor, x: torch.Tensor, dt: torch.Tensor,
              A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor, *, native: bool = True) -> torch.Tensor:
    """One Mamba-2 step per sequence, its state ``states[slots[s]]`` [heads, head_dim, N] updated in place (zeros first
    where ``fresh``): h = exp(dt A) h + dt x B^T; returns h C + D x [S, heads, head_dim]. x [S, heads, head_dim], dt [S,
    heads], A and D [heads], B and C [S, groups, N] (a group's serve its heads); all float32 (kvserve.model.mamba)."""
    if native and (_loaded or available()):
        return _ops.ssd_step_(states, slots, fresh, x.contiguous(), dt.contiguous(), A.contiguous(), B.contiguous(),
                              C.contiguous(), D.contiguous())
    per_group = states.shape[1] // B.shape[1]
    b, c = B.repeat_interleave(per_group, dim=1), C.repeat_interleave(per_group, dim=1)
    h = states[slots].masked_fill(fresh[:, None, None, None], 0) * torch.exp(dt * A)[..., None, None]
    h = h + (dt[..., None] * x)[..., None] * b[:, :, None, :]
    states[slots] = h
    return torch.einsum("shpn,shn->shp", h, c) + x * D[:, None]


def argmax_rows(logits: torch.Tensor, *, native: bool = True) -> torch.Tensor:
    """The first largest logit's index per row, as ``logits.argmax(-1)`` gives it; natively (rows in
    parallel) for CPU float32 or bf16 logits."""
    if (native and logits.dtype in (torch.float32, torch.bfloat16) and logits.device.type == "cpu"
            and (_loaded or available())):
        return _ops.argmax_rows(logits.contiguous())
    return logits.argmax(dim=-1)


def sample_rows(logits: torch.Tensor, inv_temp: torch.Tensor, u: torch.Tensor, *, native: bool = True) -> torch.Tensor:
    """One token per row of ``logits`` [R, V] (float32 or bf16, read as the floats it holds) drawn from
    softmax(logits * inv_temp) with the row's U[0, 1) number ``u``: the first token whose running mass
    exceeds u * total. A token of zero probability is never drawn; a row with no mass gets its argmax."""
    inv_temp, u = inv_temp.float().contiguous(), u.float().contiguous()
    if native and (_loaded or available()):
        return _ops.sample_rows(logits.contiguous(), inv_temp, u)
    probs = (logits.float() * inv_temp.unsqueeze(1)).softmax(dim=-1)
    cdf = probs.cumsum(dim=-1)
    pick = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    # rounding can leave u * total at or past the last sum: then the last token with mass, as the kernel does
    last = probs.shape[-1] - 1 - (probs.flip(-1) > 0).int().argmax(dim=-1)
    pick = torch.minimum(pick, last)
    empty = ~(cdf[:, -1] > 0)  # every logit -inf (NaN probabilities): the first max
    return torch.where(empty, logits.float().argmax(dim=-1), pick)


# -- availability queries --------------------------------------------------------------------------

def amx_gemm_available() -> bool:
    """Whether this build and CPU run the AMX tile kernels (``amx_linear``, ``amx_head_sample``)."""
    return available() and bool(_ops.amx_gemm_available())


def flash_prefill_available() -> bool:
    """Whether ``flash_prefill`` runs here (an AVX512-BF16 build over a torch whose brgemm does bf16: AMX)."""
    return available() and bool(_ops.flash_prefill_available())


# -- ops without a fallback: their callers take another path where the kernels are missing --------

def pack_quant(qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """A quantized weight's blocks packed for ``packed_linear`` (tiles of output columns, scales inline):
    q8_0 (int8 ``qs``), q4_1 (uint8 nibbles with ``m``) or q4_0 (nibbles, no ``m``)."""
    if not _loaded:
        _require("pack_quant")
    return _ops.pack_quant(qs, d, m)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, kind: str, n: int) -> torch.Tensor:
    """x [M, K] float32 @ W^T for a ``pack_quant`` weight of format ``kind`` with ``n`` outputs."""
    if not _loaded:
        _require("packed_linear")
    return _ops.packed_linear(x, packed, kind, n)


def read_stream(t: torch.Tensor) -> int:
    """Reads every byte of ``t`` once, on torch's threads, as the decode kernels stream their weights;
    a checksum of the bytes (for timing memory's read bandwidth)."""
    if not _loaded:
        _require("read_stream")
    return _ops.read_stream(t)


def zeros_huge(nbytes: int) -> torch.Tensor:
    """A zeroed uint8 tensor on 2 MB pages where the OS grants them (memory a decode step streams)."""
    if not _loaded:
        _require("zeros_huge")
    return _ops.zeros_huge(nbytes)


def dequantize_packed(packed: torch.Tensor, kind: str, n: int, k: int) -> torch.Tensor:
    """A ``pack_quant`` weight back as float32 [n, k]."""
    if not _loaded:
        _require("dequantize_packed")
    return _ops.dequantize_packed(packed, kind, n, k)


def amx_pack(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 weight [N, K] packed in AMX tiles for ``amx_linear`` / ``amx_head_sample``."""
    if not _loaded:
        _require("amx_pack")
    return _ops.amx_pack(weight)


def amx_linear_max_rows() -> int:
    """The most rows ``amx_linear`` takes."""
    if not _loaded:
        _require("amx_linear_max_rows")
    return int(_ops.amx_linear_max_rows())


def amx_linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] bf16 @ W^T on AMX tiles, for an ``amx_pack`` weight with ``n`` outputs."""
    if not _loaded:
        _require("amx_linear")
    return _ops.amx_linear(x, packed, n, bias)


def amx_head_sample(x: torch.Tensor, packed: torch.Tensor, n: int, inv_temp: torch.Tensor,
                    u: torch.Tensor) -> torch.Tensor:
    """An LM head's token per row of x [M, K] bf16 without writing its logits: greedy where ``inv_temp``
    is 0, else drawn as ``sample_rows`` draws with ``u``."""
    if not _loaded:
        _require("amx_head_sample")
    return _ops.amx_head_sample(x, packed, n, inv_temp, u)


def paged_attention(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_info: torch.Tensor, block_size: int, scale: float,
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                    window: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None,
                    invariant: bool = False) -> None:
    """Writes into ``out`` the attention of q's rows over the cache, read in place through the block
    tables; ``seq_info`` [S, 4]: per sequence (first row, rows, context, table offset). An 8-bit cache
    comes with its scales; ``sinks`` (float32 [heads]): a logit per query head in its softmax's denominator.
    ``invariant``: decodes over a bf16 cache skip their own faster arithmetic, so that every row's result
    depends only on its query and context (float and 8-bit caches: always)."""
    if not _loaded:
        _require("paged_attention")
    _ops.paged_attention(out, q, k_cache, v_cache, block_tables, seq_info, block_size, scale, k_scale, v_scale,
                         window=window, softcap=softcap, sinks=sinks, invariant=invariant)


def flash_prefill(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_tables: torch.Tensor, seq_info: torch.Tensor, block_size: int, scale: float,
                  window: int = 0, softcap: float = 0.0) -> None:
    """As ``paged_attention``, for prompt chunks over a bf16 cache, on AMX (where
    ``flash_prefill_available``)."""
    if not _loaded:
        _require("flash_prefill")
    _ops.flash_prefill(out, q, k_cache, v_cache, block_tables, seq_info, block_size, scale,
                       window=window, softcap=softcap)


def decode_stack(num_heads: int, num_kv_heads: int, head_dim: int, hidden: int, intermediate: int,
                 eps: float) -> Any:
    """An empty native ``DecodeStack`` (kernels/csrc/decode_stack.cpp) for a model of these sizes."""
    if not _loaded:
        _require("DecodeStack")
    return torch.classes.kvserve.DecodeStack(num_heads, num_kv_heads, head_dim, hidden, intermediate, eps)


def moe_block(hidden: int, top_k: int, norm_topk: bool, act: str, alpha: float = 1.0, limit: float = 0.0) -> Any:
    """An empty native ``MoEBlock`` (kernels/csrc/model/moe_block.h): a mixture of experts over packed
    quantized experts, ``act`` silu, gelu_tanh or swiglu (gpt-oss's, with ``alpha`` and ``limit``; 0: no clamp).
    No fallback: ``MoE`` runs its loop of experts where the kernels are not loaded."""
    if not _loaded:
        _require("MoEBlock")
    return torch.classes.kvserve.MoEBlock(hidden, top_k, norm_topk, act, alpha, limit)


# -- LoRA ----------------------------------------------------------------------------------------

def lora_apply_(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bounds: torch.Tensor,
                order: torch.Tensor, slot_of: torch.Tensor) -> None:
    """y[order[i]] += (x[order[i]] @ a[s]^T) @ b[s] (b's row k placed at y's columns ``bounds[s][k]``) with
    s = slot_of[i], float32, every adapter of a step in one call (kvserve.lora.slots lays out a, b, bounds).
    No fallback: kvserve.lora.layers runs its grouped torch GEMMs where the kernels are not loaded."""
    _require("lora_apply_")
    _ops.lora_apply_(y, x, a, b, bounds, order, slot_of)
