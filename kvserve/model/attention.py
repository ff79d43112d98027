"""A decoder layer's attention, with the options architectures differ by: biases, q/k norms (per head or
over the whole projection), clamps on q/k/v, rotary or none, the softmax scale, a sliding window, a soft cap
on the scores, sinks (a learned logit per head in the softmax's denominator), a sigmoid gate on the output, ALiBi's
biases. q, k and v come from one GEMM;
the attention backend attends (``AttentionBackend.attend_layer``)."""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from kvserve.attention import AttentionBackend, AttentionMetadata
from kvserve.attention.backend import LayerAttention
from kvserve.model.config import ModelConfig
from kvserve.model.diff_attention import DiffAttention
from kvserve.model.dynamic_mask import DynamicMask
from kvserve.model.layers import HeadLayerNorm, RMSNorm, make_norm, runs_amx
from kvserve.model.rotary import RotaryStep


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.num_heads = cfg.attention_heads(layer)
        self.num_kv_heads = cfg.attn_kv_heads(layer)
        self.head_dim = d = cfg.attn_head_dim(layer)
        self.hidden_size = cfg.hidden_size
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        # gated attention: a gate for each of q's values (or each head), after q's (weight_layout.standard_layout puts
        # them there)
        self.output_gate = cfg.attn_output_gate
        self.gate_softplus, self.gate_per_head = cfg.attn_output_gate_fn == "softplus", cfg.attn_output_gate_per_head
        gate_size = self.num_heads if self.gate_per_head else q_size
        self.gate_bias = nn.Parameter(torch.zeros(self.num_heads)) if cfg.attn_output_gate_bias else None
        # K/V from an earlier layer (q alone projected here), or values that are the keys' projection
        self.shares_kv, self.k_is_v = cfg.shares_kv(layer), bool(cfg.k_eq_v_layers and cfg.k_eq_v_layers[layer])
        self.v_norm = cfg.v_norm
        self.nvfp4 = cfg.kv_nvfp4 and cfg.window(layer) is None
        self.stores_kv = cfg.kv_shared_from is not None and not self.shares_kv and layer in cfg.kv_shared_from[layer + 1:]
        self.layer, self.source = layer, (cfg.kv_shared_from[layer] if self.shares_kv else layer)
        # values narrower than keys (v_head_dim): zero-padded to head_dim for the cache, the padding cut from the output
        self.v_dim = cfg.value_dim(layer)
        v_size = self.num_kv_heads * self.v_dim
        kv_parts = () if self.shares_kv else (kv_size,) if self.k_is_v else (kv_size, v_size)
        self.split = (q_size, *((gate_size,) if self.output_gate else ()), *kv_parts)
        self.qkv = nn.Linear(cfg.hidden_size, sum(self.split), bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.qk_norm = cfg.qk_norm if cfg.has_qk_norm(layer) else None
        self.norm_after_rope = cfg.qk_norm_after_rope
        self.layer_norms = cfg.qk_norm_type == "layer"
        self.unweighted = cfg.qk_norm_type in ("unweighted", "l2")
        self.l2 = cfg.qk_norm_type == "l2"  # over the sum of squares (unit vectors: Dory's), not the mean
        self.q_scale = nn.Parameter(torch.ones(self.num_heads * d)) if cfg.query_channel_scale else None
        self.eps = cfg.rms_norm_eps
        if self.qk_norm is None or self.unweighted:
            pass
        elif self.layer_norms:
            self.q_norm = HeadLayerNorm(self.num_heads, d, cfg.rms_norm_eps, cfg.qk_norm_per_head, cfg.qk_norm_bias)
            self.k_norm = HeadLayerNorm(self.num_kv_heads, d, cfg.rms_norm_eps, cfg.qk_norm_per_head, cfg.qk_norm_bias)
        elif cfg.qk_norm is not None:
            full = cfg.qk_norm == "full"
            self.q_norm = RMSNorm(q_size if full else d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(kv_size if full else d, cfg.rms_norm_eps)
        if self.shares_kv and hasattr(self, "k_norm"):  # its keys come normed from the layer that made them
            del self.k_norm
        q_only = (self.qk_norm in (None, "head") and cfg.qk_norm_type == "rms" and not cfg.qk_norm_after_rope
                  and cfg.clip_qkv is None and cfg.query_position_scale is None)
        if self.shares_kv and not q_only:
            raise ValueError("a layer on an earlier layer's K/V runs per-head RMS q norms before rotary only (no "
                             "whole-projection, LayerNorm or post-rotary q/k norms, q/k/v clamps or position scales)")
        self.clip = cfg.clip_qkv
        self.position_scale = cfg.query_position_scale
        # BitNet's norm of the heads' output before o_proj
        self.sub_norm = (make_norm(cfg.norm_type, q_size, cfg.rms_norm_eps, affine=cfg.norm_affine)
                         if cfg.norm_type == "l2" else RMSNorm(q_size, cfg.rms_norm_eps)) if cfg.attn_sub_norm else None
        # the sinks are a parameter (loaded after the spec is built): the step's spec takes them (forward)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads)) if cfg.has_sinks(layer) else None
        # differential attention (DiffLlama): heads attended twice as wide (kvserve.model.diff_attention), at the
        # unpadded heads' scale
        self.diff = DiffAttention(self.num_heads, self.num_kv_heads, d, layer, cfg.rms_norm_eps) \
            if cfg.diff_attention else None
        scale = cfg.attn_scale if not (cfg.diff_attention or cfg.key_bias) or cfg.attn_scale is not None else d ** -0.5
        # Doge's key bias, carried as two more key dims (kvserve.model.dynamic_mask)
        self.dyn = DynamicMask(self.num_kv_heads, d, cfg.attention_bias, scale) if cfg.key_bias else None
        self.spec = LayerAttention(scale, cfg.window(layer), cfg.attn_logit_softcap, chunk=cfg.chunk(layer))
        self.scale_nope = cfg.query_scale_nope  # the position scale on the layers without rotary (Llama 4)
        self.scale_offset = cfg.query_scale_offset
        self.scale_power = cfg.query_scale_power
        # ALiBi's slopes: the spec takes them as a tensor at the first step (the model is built on the meta device)
        self.alibi = [s * cfg.alibi_scale for s in alibi_slopes(self.num_heads, cfg.alibi_bias_max, cfg.alibi_mpt)] \
            if cfg.alibi else None
        # what the bf16 path below handles
        self.plain = (cfg.qk_norm is None and not self.spec.masked and self.sinks is None and self.clip is None
                      and self.position_scale is None and not self.output_gate and self.alibi is None
                      and len(self.split) == 3 and not self.v_norm and self.sub_norm is None and self.v_dim == d
                      and self.diff is None and self.dyn is None)

    def _head_norms(self, q: torch.Tensor, k: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k [t, heads, head_dim] normed per head (a head's reshape of the GEMM's output is a strided view:
        made contiguous)."""
        if self.unweighted:
            def norm(x):
                squares = x.float().pow(2)
                return x * torch.rsqrt((squares.sum(-1, keepdim=True) if self.l2 else squares.mean(-1, keepdim=True))
                                       + self.eps).to(x.dtype)
            return norm(q), norm(k)
        if self.layer_norms:
            return self.q_norm(q), self.k_norm(k)
        q = self.q_norm(q.reshape(-1, self.head_dim).contiguous()).view(t, self.num_heads, self.head_dim)
        k = self.k_norm(k.reshape(-1, self.head_dim).contiguous()).view(t, self.num_kv_heads, self.head_dim)
        return q, k

    def runs_bf16(self, x: torch.Tensor, attn: AttentionBackend, meta: AttentionMetadata,
                  kv_cache: tuple[torch.Tensor, torch.Tensor]) -> bool:
        """Whether q/k/v stay bf16 from the GEMM through rotary, the KV write and attention into o_proj:
        where the GEMM runs in bf16 and attention and the KV cache are bf16 anyway (AMX prefill), which
        saves the float32 round trips (~4% of a prefill). Steps the native decode stack could run keep
        its float32 arithmetic."""
        return (self.plain and kv_cache[0].dtype == torch.bfloat16 and runs_amx(self.qkv, x)
                and attn.attends_bf16(meta))

    def forward(self, x, rope: RotaryStep | None, attn: AttentionBackend, meta: AttentionMetadata,
                kv_cache: tuple[torch.Tensor, torch.Tensor], bf16: bool = False, rows: torch.Tensor | None = None,
                tokens: int | None = None, extra_qkv: torch.Tensor | None = None):
        """``bf16`` (see ``runs_bf16``): x is the bf16 input of the qkv GEMM and the output is bf16.
        ``extra_qkv``: added to the q/k/v projection's rows (a shared block's adapters: ``kvserve.model.shared_block``).
        ``rows``: every row's K/V is written but only these attend: the output is theirs.
        ``tokens``: the step's rows, where x has zero rows past them (the GEMM's padding).
        ``rope`` None: a layer whose q and k do not rotate (SmolLM3's NoPE layers)."""
        t = x.shape[0] if tokens is None else tokens
        qkv = (self.qkv(x, out_dtype=torch.bfloat16) if bf16 else self.qkv(x))[:t]
        if extra_qkv is not None:
            qkv = qkv + extra_qkv
        q, *parts = qkv.split(self.split, dim=-1)
        gate = parts.pop(0) if self.output_gate else None
        if self.shares_kv:
            q, k, v = self._q_on_shared_kv(q, t, rope, meta, rows)
        else:
            q, k, v = self._own_qkv(q, parts, t, rope, meta)
        if self.diff is not None:
            q, k, v = self.diff.widen(q, k, v)
        if self.dyn is not None:
            q, k, v = self.dyn.widen(q, k, v)
        spec = self.spec if self.sinks is None else dataclasses.replace(self.spec, sinks=self.sinks)
        if self.alibi is not None and spec.alibi is None:
            self.spec = spec = dataclasses.replace(spec, alibi=torch.tensor(self.alibi, device=q.device))
        o = attn.attend_layer(q, k, v, kv_cache, meta, spec, rows)
        if not o.shape[0]:  # no row attends (a step that samples nothing): the K/V writes were all
            return x.new_empty(0, self.hidden_size)
        if self.dyn is not None:
            o = self.dyn.narrow(o, self.num_heads)
        if self.diff is not None:
            o = self.diff.combine(o)
        if self.v_dim != self.head_dim:
            o = o.reshape(o.shape[0], self.num_heads, self.head_dim)[..., : self.v_dim]
        o = o.reshape(o.shape[0], -1)
        if gate is not None:  # (a layer on shared K/V after the rows were cut has the sampled rows' gates only)
            o = self._gated(o, gate if rows is None or gate.shape[0] == o.shape[0] else gate[rows])
        if self.sub_norm is not None:
            o = self.sub_norm(o.contiguous())
        return self.o_proj(o, out_dtype=torch.bfloat16) if bf16 else self.o_proj(o)

    def _own_qkv(self, q: torch.Tensor, parts: list[torch.Tensor], t: int, rope: RotaryStep | None,
                 meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k [t, heads, head_dim] normed, clamped, rotated and scaled; v padded to head_dim and normed (``k_is_v``:
        the keys' projection, before their norm and rotary, which may rotate k in place); kept for the layers that read
        them (``stores_kv``)."""
        k, v = (parts[0], parts[0].clone()) if self.k_is_v else parts
        if self.qk_norm == "full":
            q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        if self.clip is not None:
            q, k, v = q.clamp(-self.clip, self.clip), k.clamp(-self.clip, self.clip), v.clamp(-self.clip, self.clip)
        q, k = q.reshape(t, self.num_heads, self.head_dim), k.reshape(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head" and not self.norm_after_rope:
            q, k = self._head_norms(q, k, t)
        if rope is not None:
            q, k = rope.apply(q, k)
        if self.norm_after_rope and self.qk_norm is not None:
            q, k = self._head_norms(q, k, t)
        if self.position_scale is not None and (rope is None) == self.scale_nope:
            beta, length = self.position_scale
            positions = rope.positions[:t] if rope is not None else step_positions(meta, q.device)
            if self.scale_power:
                scale = torch.exp(beta * torch.log1p((positions + self.scale_offset).float() / length))
            else:
                scale = 1 + beta * torch.log1p(torch.div(positions + self.scale_offset, length,
                                                         rounding_mode="floor").float())
            q = q * scale.to(q.dtype)[:, None, None]
        if self.q_scale is not None:
            q = q * self.q_scale.view(self.num_heads, self.head_dim).to(q.dtype)
        v = v.reshape(t, self.num_kv_heads, self.v_dim)
        if self.v_dim != self.head_dim:
            v = torch.nn.functional.pad(v, (0, self.head_dim - self.v_dim))
        if self.v_norm:
            v = rms_unweighted(v, self.eps)
        if self.nvfp4:  # (before the cache and the layers sharing them: each reads them rounded once)
            k, v = nvfp4_values(k), nvfp4_values(v)
        if self.stores_kv:
            shared_kv(meta)[self.layer] = (k, v)
        return q, k, v

    def _q_on_shared_kv(self, q: torch.Tensor, t: int, rope: RotaryStep | None, meta: AttentionMetadata,
                        rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, heads, head_dim] normed and rotated, over the K/V an earlier layer of this step made (written to the
        same slots again by the backend); where the stream holds only the rows that sample (``CausalLM.rows_from``), q
        at their rows among the step's (the others are never read), for rotary's positions and the backend."""
        k, v = shared_kv(meta)[self.source]
        q = q.reshape(t, self.num_heads, self.head_dim)
        if self.qk_norm == "head":
            q = self.q_norm(q.reshape(-1, self.head_dim).contiguous()).view_as(q)
        if rows is not None and t != k.shape[0]:
            q = q.new_zeros(k.shape[0], *q.shape[1:]).index_copy_(0, rows, q)
        return (q if rope is None else rope.apply_q(q)), k, v

    def _gated(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """Attention's output [rows, heads x head_dim] times its gate: sigmoid, or softplus (in float32, as Laguna's
        reference computes it), one value each of o's or one a head; a head's ``gate_bias`` added to its gates first."""
        if self.gate_bias is not None:
            per_head = gate.view(gate.shape[0], self.num_heads, -1) + self.gate_bias[:, None].to(gate.dtype)
            gate = per_head.view(gate.shape)
        g = torch.nn.functional.softplus(gate.float()).to(o.dtype) if self.gate_softplus else torch.sigmoid(gate)
        if self.gate_per_head:
            return (o.view(o.shape[0], self.num_heads, self.head_dim) * g[..., None]).view(o.shape)
        return o * g


def rms_unweighted(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x RMS-normed over its last dim, without a weight (in float32, as the checkpoints' norms compute)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def nvfp4_values(x: torch.Tensor) -> torch.Tensor:
    """x rounded to NVFP4's values and back: each 16 consecutive values of the last dim share a scale (their largest
    magnitude / 6, as an E4M3 float within [2^-9, 448]), each an E2M1 multiple of it (steps of 0.5 below 2, 1 below
    4, 2 up to 6), ties to even."""
    blocks = x.float().reshape(*x.shape[:-1], -1, 16)
    scale = (blocks.abs().amax(-1, keepdim=True) / 6).clamp(2 ** -9, 448).to(torch.float8_e4m3fn).float()
    scaled = blocks / scale
    size = scaled.abs().clamp(max=6)
    step = torch.where(size < 2, 0.5, torch.where(size < 4, 1.0, 2.0))
    return ((torch.round(size / step) * step).copysign(scaled) * scale).reshape(x.shape).to(x.dtype)


def shared_kv(meta: AttentionMetadata) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """This step's K/V of the layers later layers attend over (``ModelConfig.kv_shared_from``), by layer."""
    memo = getattr(meta, "shared_kv", None)
    if memo is None:
        memo = meta.shared_kv = {}  # type: ignore[attr-defined]
    return memo


def step_positions(meta: AttentionMetadata, device: torch.device) -> torch.Tensor:
    """Every row's position in the step [T] (for a layer without rotary, whose step has none); once a step."""
    memo = getattr(meta, "positions", None)
    if memo is None:
        memo = torch.cat([torch.arange(s.start, s.end, device=device) for s in meta.seqs])
        meta.positions = memo  # type: ignore[attr-defined]
    return memo


def alibi_slopes(heads: int, bias_max: float = 8.0, mpt: bool = False) -> list[float]:
    """ALiBi's slope per head: for n heads (n a power of two) 2^(-bias_max k / n), k = 1..n. Otherwise the ALiBi paper's
    and Bloom's rule: those of the power of two below n, then every other one of twice that many; MPT's: those of the
    power of two above n, the odd k first, then the even ones, the first n."""
    def of(n: int) -> list[float]:
        return [2 ** (-bias_max * k / n) for k in range(1, n + 1)]

    if mpt:
        above = of(2 ** math.ceil(math.log2(heads)))
        return (above[1::2] + above[0::2])[:heads] if len(above) != heads else above
    below = 2 ** math.floor(math.log2(heads))
    return of(below) + of(2 * below)[0::2][: heads - below]
