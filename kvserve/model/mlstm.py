"""xLSTM's mLSTM layer as a token mixer: q, k, v and the output gate's input from ``in_proj``; per head an input and a
forget gate (soft-capped, with biases: ``gates``); per head a matrix memory C [qk, v] and a normalizer n [qk] under a
running exponent m (so that the exponential input gate never overflows):

    m' = max(log sigmoid(f) + m, i);  C = e^(log sigmoid(f) + m - m') C + e^(i - m') k v^T;  n likewise with k;
    h = (q / sqrt(qk)) C / (max(|(q / sqrt(qk)) . n|, e^-m') + eps),

then a LayerNorm per head of h, times sigmoid(output gate), through ``out_proj``. The state per sequence (C, n and m,
packed in one float32 tensor [heads, qk + 1, v + 1]) is ``kvserve.model.recurrent``'s, with no convolution; every row
runs the step in turn (the recurrent form, as transformers' decode steps and short prompts run it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.attention import AttentionBackend, AttentionMetadata
from kvserve.model.config import ModelConfig
from kvserve.model.recurrent import RecurrentMixer
from kvserve.model.rotary import RotaryStep


class MLSTM(RecurrentMixer):
    def __init__(self, cfg: ModelConfig, layer: int):  # (``layer``: the mixers' one signature)
        shape = cfg.mlstm
        assert shape is not None
        self.heads, self.qk, self.v = shape.heads, shape.qk_dim, shape.v_dim
        if self.qk % self.heads or self.v % self.heads:
            raise ValueError(f"mLSTM widths {self.qk} (q/k) and {self.v} (v) do not split into {self.heads} heads")
        self.dk, self.dv = self.qk // self.heads, self.v // self.heads
        # (no convolution: one tap, an empty convolution state)
        super().__init__(2 * self.qk + self.v, 1, (self.heads, self.dk + 1, self.dv + 1), conv_bias=False)
        self.kernel = None
        self.gate_cap, self.eps = shape.gate_cap, shape.eps
        self.in_proj = nn.Linear(cfg.hidden_size, 2 * self.qk + 2 * self.v, bias=False)  # q, k, v, output gate
        self.gates = nn.Linear(cfg.hidden_size, 2 * self.heads, bias=True)  # input gates, then forget gates
        self.norm_weight = nn.Parameter(torch.ones(self.v))  # the per-head LayerNorm's weight, head after head
        self.norm_eps = shape.norm_eps
        self.out_proj = nn.Linear(self.v, cfg.hidden_size, bias=False)

    def convolve(self, u: torch.Tensor, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return u, prev

    def forward(self, x, rope: RotaryStep | None, attn: AttentionBackend, meta: AttentionMetadata,
                kv_cache: list, bf16: bool = False, rows: torch.Tensor | None = None, tokens: int | None = None):
        """As ``Attention.forward`` (``rope`` and ``kv_cache`` unused): every row's state advances, the output is
        ``rows``' only."""
        t = x.shape[0] if tokens is None else tokens
        qkv, o = self.in_proj(x)[:t].split([self.channels, self.v], dim=-1)
        gates = self.gates(x[:t]).float()
        if self.gate_cap is not None:
            gates = self.gate_cap * torch.tanh(gates / self.gate_cap)
        i, f = gates.split([self.heads, self.heads], dim=-1)
        h = self.run_sequences(meta, qkv, [i, f], self.v)
        if rows is not None:
            h, o = h[rows], o[rows]
        h = F.layer_norm(h.float().view(h.shape[0], self.heads, self.dv), (self.dv,), None, None, self.norm_eps)
        h = (h.flatten(1) * self.norm_weight.float()).to(o.dtype)
        return self.out_proj(torch.sigmoid(o) * h)

    def recurrence(self, u: torch.Tensor, i: torch.Tensor, f: torch.Tensor,
                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The mLSTM over u [S, L, q + k + v] with gates i, f [S, L, heads] from ``state`` [S, heads, qk + 1, v + 1]
        (C in [:qk, :v], n in [:qk, v], m in [qk, 0]; zeros: a fresh state), in float32: h [S, L, v] and the state."""
        s, length = u.shape[:2]
        q, k, v = u.float().split([self.qk, self.qk, self.v], dim=-1)
        q = q.view(s, length, self.heads, self.dk) * self.dk ** -0.5
        k, v = k.view(s, length, self.heads, self.dk), v.view(s, length, self.heads, self.dv)
        c, n, m = state[..., :self.dk, :self.dv], state[..., :self.dk, self.dv], state[..., self.dk, 0]
        log_f = F.logsigmoid(f.float())
        out = []
        for t in range(length):
            m_next = torch.maximum(log_f[:, t] + m, i[:, t])  # [S, heads]
            keep, write = torch.exp(log_f[:, t] + m - m_next), torch.exp(i[:, t] - m_next)
            c = keep[..., None, None] * c + write[..., None, None] * (k[:, t, :, :, None] * v[:, t, :, None, :])
            n = keep[..., None] * n + write[..., None] * k[:, t]
            m = m_next
            num = torch.einsum("shd,shde->she", q[:, t], c)
            den = torch.maximum((q[:, t] * n).sum(-1).abs(), torch.exp(-m)) + self.eps
            out.append(num / den[..., None])
        state = torch.zeros_like(state)
        state[..., :self.dk, :self.dv], state[..., :self.dk, self.dv], state[..., self.dk, 0] = c, n, m
        return torch.stack(out, dim=1).flatten(2), state
