"""A Mamba-2 layer as a token mixer (Granite 4.0 H, Bamba): in_proj to the gate z, the convolution's input (x, B, C)
and the step sizes dt; a depthwise causal convolution of ``mamba_conv_kernel`` taps over (x, B, C) with SiLU; the
selective state space recurrence per head, h = exp(dt * A) * h + dt * x B^T, y = h C + D * x; an RMSNorm per group of
y * silu(z); out_proj.

Each sequence keeps two states from one step to the next, in its slot (``SeqRows.state_slot``, which the KV manager
gives it while it runs): the convolution's last kernel - 1 inputs and the recurrence's h [heads, head_dim, state],
in float32. A sequence whose step starts at position 0 starts from zeros (a new or a preempted one), so chunked
prefill and preemption carry the state; a prefix-cache hit could not (the state is the whole sequence's), and such
models run without the prefix cache. A prompt chunk runs the recurrence block by block (the state space duality's
quadratic form within a block of ``BLOCK`` tokens, the state carried across blocks); decode rows run one step each,
every sequence's at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.attention import AttentionBackend, AttentionMetadata
from kvserve.attention.backend import SeqRows
from kvserve.model.config import ModelConfig
from kvserve.model.rotary import RotaryStep

BLOCK = 64  # tokens a prompt chunk's recurrence handles at once: [BLOCK, BLOCK] per head of intermediate values


@dataclass
class SlotStates:
    """Every state slot's: the convolution's previous inputs [slots, taps - 1, channels] and h [slots, heads,
    head_dim, state] (not parameters: the model's weight count leaves them out)."""

    conv: torch.Tensor
    ssm: torch.Tensor


class Mamba2(nn.Module):
    plain = False  # the decoder's bf16 hand-offs are attention's
    sinks = None

    def __init__(self, cfg: ModelConfig, layer: int):  # (``layer``: the mixers' one signature)
        super().__init__()
        self.heads, self.head_dim = cfg.mamba_heads, cfg.mamba_head_dim
        self.groups, self.state_size, self.taps = cfg.mamba_groups, cfg.mamba_state_size, cfg.mamba_conv_kernel
        self.inner = cfg.mamba_inner
        if self.heads % self.groups:
            raise ValueError(f"{self.heads} Mamba heads do not split into {self.groups} groups")
        self.conv_dim = self.inner + 2 * self.groups * self.state_size
        self.in_proj = nn.Linear(cfg.hidden_size, self.inner + self.conv_dim + self.heads, bias=cfg.mamba_proj_bias)
        self.kernel = nn.Parameter(torch.zeros(self.conv_dim, self.taps))  # [channels, taps], oldest first
        self.conv_bias = nn.Parameter(torch.zeros(self.conv_dim)) if cfg.mamba_conv_bias else None
        self.dt_bias = nn.Parameter(torch.zeros(self.heads))
        self.A_log = nn.Parameter(torch.zeros(self.heads))
        self.D = nn.Parameter(torch.ones(self.heads))
        self.norm_weight = nn.Parameter(torch.ones(self.inner))
        self.eps = cfg.rms_norm_eps
        self.dt_limit = cfg.mamba_dt_limit
        self.out_proj = nn.Linear(self.inner, cfg.hidden_size, bias=cfg.mamba_proj_bias)
        self.states: SlotStates | None = None  # allocate_states

    def state_bytes(self, dtype: torch.dtype) -> int:
        """Bytes one sequence's state takes (the convolution's inputs in ``dtype``, h in float32)."""
        return (max(self.taps - 1, 0) * self.conv_dim * torch.empty(0, dtype=dtype).element_size()
                + self.heads * self.head_dim * self.state_size * 4)

    def allocate_states(self, slots: int, dtype: torch.dtype, device: torch.device) -> None:
        """Room for ``slots`` sequences' states (0: none; a step may then only start sequences, unkept)."""
        self.states = None if not slots else SlotStates(
            torch.zeros(slots, max(self.taps - 1, 0), self.conv_dim, dtype=dtype, device=device),
            torch.zeros(slots, self.heads, self.head_dim, self.state_size, device=device))

    def runs_bf16(self, *args) -> bool:
        return False

    def forward(self, x, rope: RotaryStep | None, attn: AttentionBackend, meta: AttentionMetadata,
                kv_cache: list, bf16: bool = False, rows: torch.Tensor | None = None, tokens: int | None = None):
        """As ``Attention.forward`` (``rope`` and ``kv_cache`` unused): every row's state advances, the output is
        ``rows``' only."""
        t = x.shape[0] if tokens is None else tokens
        z, xbc, dt = self.in_proj(x)[:t].split([self.inner, self.conv_dim, self.heads], dim=-1)
        y = x.new_empty(t, self.inner)
        for idx, seqs in groups_by_length(meta.seqs, x.device):
            slots = [s.state_slot for s in seqs]
            if any(s.start > 0 and (slot < 0 or self.states is None) for s, slot in zip(seqs, slots)):
                raise RuntimeError("a Mamba layer continues a sequence without a state slot")
            conv_prev, h = self._states_of(slots, [s.start == 0 for s in seqs], xbc.dtype, x.device)
            u, conv_next = self._convolve(xbc[idx], conv_prev)
            out, h = self._scan(u, dt[idx], h)
            y[idx.flatten()] = out.flatten(2).flatten(0, 1).to(y.dtype)
            keep = [i for i, slot in enumerate(slots) if slot >= 0]
            if keep and self.states is not None:
                at = torch.tensor([slots[i] for i in keep], device=x.device)
                which = torch.tensor(keep, device=x.device)
                self.states.conv[at] = conv_next[which].to(self.states.conv.dtype)
                self.states.ssm[at] = h[which]
        y = self._gated_norm(y, z)
        return self.out_proj(y if rows is None else y[rows])

    def _states_of(self, slots: list[int], fresh: list[bool], dtype: torch.dtype,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The states the sequences continue from: their slots', zeros where a sequence starts (or has no slot)."""
        n = len(slots)
        conv = torch.zeros(n, self.taps - 1, self.conv_dim, dtype=dtype, device=device)
        h = torch.zeros(n, self.heads, self.head_dim, self.state_size, device=device)
        go_on = [i for i in range(n) if not fresh[i] and slots[i] >= 0]
        if go_on and self.states is not None:
            at = torch.tensor([slots[i] for i in go_on], device=device)
            which = torch.tensor(go_on, device=device)
            conv[which] = self.states.conv[at].to(dtype)
            h[which] = self.states.ssm[at]
        return conv, h

    def _convolve(self, xbc: torch.Tensor, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """xbc [S, L, channels] after ``prev`` [S, taps - 1, channels]: the convolution's output with SiLU, and the
        last taps - 1 inputs (the next state)."""
        window = torch.cat([prev.to(xbc.dtype), xbc], dim=1)  # [S, taps - 1 + L, channels]
        taps = window.unfold(1, self.taps, 1)  # [S, L, channels, taps]
        out = (taps * self.kernel.to(xbc.dtype)).sum(-1)
        if self.conv_bias is not None:
            out = out + self.conv_bias.to(out.dtype)
        return F.silu(out), window[:, window.shape[1] - (self.taps - 1):]

    def _scan(self, u: torch.Tensor, dt: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The recurrence over u [S, L, conv channels] (x, B, C) with step sizes dt [S, L, heads] from state h
        [S, heads, head_dim, state], in float32: y [S, L, heads, head_dim] and the state after the last token."""
        s, length = u.shape[:2]
        x, b, c = u.float().split([self.inner, self.groups * self.state_size, self.groups * self.state_size], dim=-1)
        x = x.view(s, length, self.heads, self.head_dim)
        per_group = self.heads // self.groups  # B and C of a group serve its heads
        b = b.view(s, length, self.groups, self.state_size).repeat_interleave(per_group, dim=2)
        c = c.view(s, length, self.groups, self.state_size).repeat_interleave(per_group, dim=2)
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(*self.dt_limit)
        decay = dt * -torch.exp(self.A_log.float())  # log of the per-step decay, [S, L, heads]
        xdt = x * dt[..., None]
        out = []
        for start in range(0, length, BLOCK):
            end = min(start + BLOCK, length)
            y, h = ssd_block(xdt[:, start:end], decay[:, start:end], b[:, start:end], c[:, start:end], h)
            out.append(y)
        y = torch.cat(out, dim=1) if len(out) > 1 else out[0]
        return y + x * self.D.float()[:, None], h

    def _gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm over each group of y * silu(z), times the weight (in float32, back to y's dtype before the weight,
        as transformers rounds)."""
        g = (y.float() * F.silu(z.float())).view(y.shape[0], self.groups, -1)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.norm_weight * g.view(y.shape[0], self.inner).to(y.dtype)


def ssd_block(xdt: torch.Tensor, decay: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
              h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One block of the recurrence without its D term: xdt [S, L, H, P] (x times dt), decay [S, L, H] (dt * A), b and c
    [S, L, H, N], h [S, H, P, N] the state before the block. y_t = C_t . (sum over j <= t of exp(cum_t - cum_j) xdt_j
    B_j^T + exp(cum_t) h): a masked [L, L] product per head, and the state after the block."""
    cum = decay.cumsum(dim=1)  # [S, L, H]
    if xdt.shape[1] == 1:  # one token: the recurrence's step itself
        h = h * cum[:, 0, :, None, None].exp() + xdt[:, 0, :, :, None] * b[:, 0, :, None, :]
        return torch.einsum("shpn,shn->shp", h, c[:, 0])[:, None], h
    length = xdt.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=xdt.device).tril()
    gaps = (cum[:, :, None, :] - cum[:, None, :, :]).masked_fill(~causal[None, :, :, None], float("-inf")).exp()
    scores = torch.einsum("sthn,sjhn->stjh", c, b) * gaps  # [S, L (to), L (from), H]
    y = torch.einsum("stjh,sjhp->sthp", scores, xdt)
    y = y + torch.einsum("sthn,shpn->sthp", c, h) * cum.exp()[..., None]
    to_end = (cum[:, -1:] - cum).exp()  # [S, L, H]
    h = h * cum[:, -1, :, None, None].exp() + torch.einsum("sjh,sjhp,sjhn->shpn", to_end, xdt, b)
    return y, h


def groups_by_length(seqs: Sequence[SeqRows], device: torch.device) -> list[tuple[torch.Tensor, list[SeqRows]]]:
    """The step's sequences grouped by their row count (decodes together), each group's row indices [S, L]."""
    groups: dict[int, tuple[list[list[int]], list[SeqRows]]] = {}
    first = 0
    for seq in seqs:
        n = len(seq.tokens)
        rows, members = groups.setdefault(n, ([], []))
        rows.append(list(range(first, first + n)))
        members.append(seq)
        first += n
    return [(torch.tensor(rows, device=device), members) for rows, members in groups.values()]
