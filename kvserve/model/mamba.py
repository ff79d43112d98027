"""Mamba layers as token mixers. Mamba-2 (Granite 4.0 H, Bamba, Nemotron-H, Mamba-Codestral, Falcon-H1): in_proj to
the gate z, the convolution's input (x, B, C) and the step sizes dt; a depthwise causal convolution of
``mamba_conv_kernel`` taps over (x, B, C) with SiLU; the selective state space recurrence per head, h = exp(dt * A) * h
+ dt * x B^T, y = h C + D * x; an RMSNorm per group of y * silu(z); out_proj.

The states per sequence (the convolution's last inputs, h [heads, head_dim, state]) are ``kvserve.model.recurrent``'s.
A prompt chunk runs the recurrence block by block (the state space duality's quadratic form within a block of
``BLOCK`` tokens, the state carried across blocks); decode rows run one step each, every sequence's at once
(``kernels.ops.ssd_step_``). Mamba-1 (Mamba, Falcon Mamba, Jamba: ``Mamba1``) keeps a state per channel instead of per
head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.attention import AttentionBackend, AttentionMetadata
from kvserve.kernels import ops
from kvserve.model.config import ModelConfig
from kvserve.model.recurrent import RecurrentMixer
from kvserve.model.rotary import RotaryStep

BLOCK = 64  # tokens a prompt chunk's recurrence handles at once: [BLOCK, BLOCK] per head of intermediate values


class Mamba2(RecurrentMixer):
    def __init__(self, cfg: ModelConfig, layer: int):  # (``layer``: the mixers' one signature)
        self.heads, self.head_dim = cfg.mamba_heads, cfg.mamba_head_dim
        self.groups, self.state_size = cfg.mamba_groups, cfg.mamba_state_size
        self.inner = cfg.mamba_inner
        if self.heads % self.groups:
            raise ValueError(f"{self.heads} Mamba heads do not split into {self.groups} groups")
        self.conv_dim = self.inner + 2 * self.groups * self.state_size
        super().__init__(self.conv_dim, cfg.mamba_conv_kernel, (self.heads, self.head_dim, self.state_size),
                         cfg.mamba_conv_bias)
        self.in_proj = nn.Linear(cfg.hidden_size, self.inner + self.conv_dim + self.heads, bias=cfg.mamba_proj_bias)
        self.dt_bias = nn.Parameter(torch.zeros(self.heads))
        self.A_log = nn.Parameter(torch.zeros(self.heads))
        self.D = nn.Parameter(torch.ones(self.heads))
        self.norm = cfg.mamba_norm
        self.norm_weight = nn.Parameter(torch.ones(self.inner)) if self.norm != "none" else None
        self.eps = cfg.rms_norm_eps if cfg.mamba_norm_eps is None else cfg.mamba_norm_eps
        self.dt_limit = cfg.mamba_dt_limit
        out_bias = cfg.mamba_proj_bias if cfg.mamba_out_bias is None else cfg.mamba_out_bias
        self.out_proj = nn.Linear(self.inner, cfg.hidden_size, bias=out_bias)

    def forward(self, x, rope: RotaryStep | None, attn: AttentionBackend, meta: AttentionMetadata,
                kv_cache: list, bf16: bool = False, rows: torch.Tensor | None = None, tokens: int | None = None):
        """As ``Attention.forward`` (``rope`` and ``kv_cache`` unused): every row's state advances, the output is
        ``rows``' only."""
        t = x.shape[0] if tokens is None else tokens
        z, xbc, dt = self.in_proj(x)[:t].split([self.inner, self.conv_dim, self.heads], dim=-1)
        y = self.run_sequences(meta, xbc, [dt], self.inner)
        y = self._gated_norm(y, z)
        return self.out_proj(y if rows is None else y[rows])

    def _inputs(self, u: torch.Tensor, dt: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [S, L, heads, head_dim], B and C [S, L, groups, state] from the convolution's output, and the step sizes
        [S, L, heads] after softplus and their limits; float32."""
        s, length = u.shape[:2]
        x, b, c = u.float().split([self.inner, self.groups * self.state_size, self.groups * self.state_size], dim=-1)
        return (x.view(s, length, self.heads, self.head_dim), b.view(s, length, self.groups, self.state_size),
                c.view(s, length, self.groups, self.state_size),
                F.softplus(dt.float() + self.dt_bias.float()).clamp(*self.dt_limit))

    def step(self, u: torch.Tensor, dt: torch.Tensor, *, states: torch.Tensor, slots: torch.Tensor,
             fresh: torch.Tensor) -> torch.Tensor:
        x, b, c, dt = self._inputs(u, dt)
        y = ops.ssd_step_(states, slots, fresh, x[:, 0], dt[:, 0], -torch.exp(self.A_log.float()), b[:, 0], c[:, 0],
                          self.D.float(), native=self.native)
        return y.flatten(1)[:, None]

    def recurrence(self, u: torch.Tensor, dt: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The recurrence over u [S, L, conv channels] (x, B, C) with step sizes dt [S, L, heads] from state h
        [S, heads, head_dim, state], in float32: y [S, L, heads * head_dim] and the state after the last token."""
        length = u.shape[1]
        x, b, c, dt = self._inputs(u, dt)
        per_group = self.heads // self.groups  # B and C of a group serve its heads
        b, c = b.repeat_interleave(per_group, dim=2), c.repeat_interleave(per_group, dim=2)
        decay = dt * -torch.exp(self.A_log.float())  # log of the per-step decay, [S, L, heads]
        xdt = x * dt[..., None]
        out = []
        for start in range(0, length, BLOCK):
            end = min(start + BLOCK, length)
            y, h = ssd_block(xdt[:, start:end], decay[:, start:end], b[:, start:end], c[:, start:end], h)
            out.append(y)
        y = torch.cat(out, dim=1) if len(out) > 1 else out[0]
        return (y + x * self.D.float()[:, None]).flatten(2), h

    def _gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm over each group of y * silu(z), times the weight (in float32, back to y's dtype before the weight,
        as transformers rounds); or the norm of y, then times silu(z); or y * silu(z) alone (``ModelConfig.mamba_norm``)."""
        gate = F.silu(z.float())
        if self.norm_weight is None:
            return (y.float() * gate).to(y.dtype)
        g = (y.float() * gate if self.norm == "gated" else y.float()).view(y.shape[0], self.groups, -1)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.norm == "gated":
            return self.norm_weight * g.view(y.shape[0], self.inner).to(y.dtype)
        return (self.norm_weight.float() * g.view(y.shape[0], self.inner) * gate).to(y.dtype)


def ssd_block(xdt: torch.Tensor, decay: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
              h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One block of the recurrence without its D term: xdt [S, L, H, P] (x times dt), decay [S, L, H] (dt * A), b and c
    [S, L, H, N], h [S, H, P, N] the state before the block. y_t = C_t . (sum over j <= t of exp(cum_t - cum_j) xdt_j
    B_j^T + exp(cum_t) h): a masked [L, L] product per head, and the state after the block."""
    cum = decay.cumsum(dim=1)  # [S, L, H]
    length = xdt.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=xdt.device).tril()
    gaps = (cum[:, :, None, :] - cum[:, None, :, :]).masked_fill(~causal[None, :, :, None], float("-inf")).exp()
    scores = torch.einsum("sthn,sjhn->stjh", c, b) * gaps  # [S, L (to), L (from), H]
    y = torch.einsum("stjh,sjhp->sthp", scores, xdt)
    y = y + torch.einsum("sthn,shpn->sthp", c, h) * cum.exp()[..., None]
    to_end = (cum[:, -1:] - cum).exp()  # [S, L, H]
    h = h * cum[:, -1, :, None, None].exp() + torch.einsum("sjh,sjhp,sjhn->shpn", to_end, xdt, b)
    return y, h


class Mamba1(RecurrentMixer):
    """A Mamba-1 layer (Mamba, Falcon Mamba, Jamba): in_proj to x and the gate z; the depthwise causal convolution over x
    with SiLU; x_proj to dt's low-rank part, B and C (each RMS-normed: Falcon Mamba without a weight, Jamba with), dt =
    softplus(dt_proj(...)); per channel a state of ``mamba_state_size``: h = exp(dt A) h + dt x B, y = h C + D x;
    y * silu(z); out_proj. Every token in turn (the decay differs per channel and state: no block form here)."""

    def __init__(self, cfg: ModelConfig, layer: int):  # (``layer``: the mixers' one signature)
        self.inner, self.state_size, self.rank = cfg.mamba_inner, cfg.mamba_state_size, cfg.mamba_dt_rank
        # Zamba's heads: each head's channels give its own dt, B and C (x_proj and dt_proj block-diagonal)
        self.heads = max(1, cfg.mamba_heads)
        super().__init__(self.inner, cfg.mamba_conv_kernel, (self.inner, self.state_size), cfg.mamba_conv_bias)
        self.in_proj = nn.Linear(cfg.hidden_size, 2 * self.inner, bias=cfg.mamba_proj_bias)
        self.x_proj = nn.Linear(self.inner, self.heads * (self.rank + 2 * self.state_size), bias=False)
        self.dt_proj = nn.Linear(self.heads * self.rank, self.inner, bias=True)
        self.A_log = nn.Parameter(torch.zeros(self.inner, self.state_size))
        self.D = nn.Parameter(torch.ones(self.inner))
        self.norm_eps = cfg.mamba_bcdt_norm_eps
        # Jamba's norms of dt, B and C have weights
        self.bcdt_weights = nn.ParameterList(nn.Parameter(torch.ones(n)) for n in (self.rank, self.state_size,
                                                                                   self.state_size)) \
            if cfg.mamba_bcdt_norm_weights else None
        self.out_proj = nn.Linear(self.inner, cfg.hidden_size, bias=cfg.mamba_proj_bias)

    def forward(self, x, rope: RotaryStep | None, attn: AttentionBackend, meta: AttentionMetadata,
                kv_cache: list, bf16: bool = False, rows: torch.Tensor | None = None, tokens: int | None = None):
        """As ``Mamba2.forward``."""
        t = x.shape[0] if tokens is None else tokens
        u, z = self.in_proj(x)[:t].chunk(2, dim=-1)
        y = self.run_sequences(meta, u, [z], self.inner)
        return self.out_proj(y if rows is None else y[rows])

    def recurrence(self, u: torch.Tensor, z: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The selective scan over u [S, L, inner] (after the convolution) from h [S, inner, state], gated by z: y [S,
        L, inner] and the state after the last token (the recurrence in float32)."""
        s, length, heads = u.shape[0], u.shape[1], self.heads
        proj = self.x_proj(u).view(s, length, heads, -1)
        dt, b, c = proj.split([self.rank, self.state_size, self.state_size], dim=-1)  # each [S, L, heads, ...]
        if self.norm_eps is not None:
            dt, b, c = (unweighted_rms_norm(v, self.norm_eps) for v in (dt, b, c))
            if self.bcdt_weights is not None:
                dt, b, c = (w * v for w, v in zip(self.bcdt_weights, (dt, b, c)))
        dt = F.softplus(self.dt_proj(dt.flatten(2)).float())  # [S, L, inner]
        a = -torch.exp(self.A_log.float())  # [inner, state]
        uf, b, c = u.float(), b.float(), c.float()
        n = self.state_size
        out = []
        for i in range(length):
            write = (dt[:, i] * uf[:, i]).view(s, heads, -1, 1) * b[:, i, :, None, :]  # [S, heads, head dims, state]
            h = torch.exp(dt[:, i, :, None] * a) * h + write.view(s, self.inner, n)
            out.append(torch.einsum("shdn,shn->shd", h.view(s, heads, -1, n), c[:, i]).reshape(s, self.inner))
        y = torch.stack(out, dim=1) + uf * self.D.float()
        return y * F.silu(z.float()), h


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class AttentionBesideMamba(nn.Module):
    """Falcon-H1's token mixer: attention and a Mamba-2 layer over the same input, their outputs summed (each one's
    multipliers folded into its weights at load)."""

    plain = False
    sinks = None

    def __init__(self, cfg: ModelConfig, layer: int, attention: nn.Module):
        super().__init__()
        self.attn, self.mamba = attention, Mamba2(cfg, layer)

    def runs_bf16(self, *args) -> bool:
        return False

    def forward(self, x, rope: RotaryStep | None, attn: AttentionBackend, meta: AttentionMetadata, kv_cache,
                bf16: bool = False, rows: torch.Tensor | None = None, tokens: int | None = None):
        return self.attn(x, rope, attn, meta, kv_cache, False, rows, tokens) + \
            self.mamba(x, rope, attn, meta, kv_cache, False, rows, tokens)
