"""RWKV-4's token mixers: each RWKV block is two of the decoder's layers (``ModelConfig.rwkv_mix``), a time mix and a
channel mix, each after its own LayerNorm. Both read each token beside the previous token's input (the token shift:
x * m + previous * (1 - m), with a learned m per channel and projection):

- time mix: k, v and sigmoid(r) from their own shifted inputs; per channel the WKV average of the values so far,
  weighted exp(k_j - (t - 1 - j) exp(decay)) for earlier tokens and exp(first + k_t) for the token itself, kept as a
  numerator, a denominator and their common exponent (so that no exp overflows); r * wkv through ``out_proj``;
- channel mix: sigmoid(r) * out_proj(relu(key)^2).

The previous token's input is the convolution state of ``kvserve.model.recurrent`` (a kernel of 2 taps, the shift
applied in ``convolve``); the time mix's recurrent state is (numerator, denominator, exponent) per channel, in float32.
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.attention import AttentionBackend, AttentionMetadata
from kvserve.model.config import ModelConfig
from kvserve.model.recurrent import RecurrentMixer
from kvserve.model.rotary import RotaryStep


class _Shifted(RecurrentMixer):
    """A mixer over each token's input and the previous one's (zeros before a sequence's first token)."""

    def __init__(self, hidden: int, state_shape: tuple[int, ...]):
        super().__init__(hidden, 2, state_shape, conv_bias=False)
        self.kernel = None  # (no convolution: ``convolve`` hands on the two inputs)

    def convolve(self, u: torch.Tensor, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """u [S, L, hidden] after ``prev`` [S, 1, hidden]: [S, L, 2 * hidden] (each token's input, then the previous
        token's), and the last input."""
        window = torch.cat([prev.to(u.dtype), u], dim=1)
        return torch.cat([u, window[:, :-1]], dim=-1), window[:, -1:]

    def forward(self, x, rope: RotaryStep | None, attn: AttentionBackend, meta: AttentionMetadata,
                kv_cache: list, bf16: bool = False, rows: torch.Tensor | None = None, tokens: int | None = None):
        """As ``Attention.forward`` (``rope`` and ``kv_cache`` unused): every row's state advances, the output is
        ``rows``' only."""
        t = x.shape[0] if tokens is None else tokens
        y = self.run_sequences(meta, x[:t], [], self.width)
        return self.out_proj(y if rows is None else y[rows])

    def mix(self, u: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        """The token shift's mix of u [S, L, 2 * hidden] (token, previous) by m [hidden], as rows [S * L, hidden]."""
        x, prev = u.flatten(0, 1).chunk(2, dim=-1)
        return x * m + prev * (1 - m)


class RwkvTimeMix(_Shifted):
    def __init__(self, cfg: ModelConfig, layer: int):  # (``layer``: the mixers' one signature)
        h, self.width = cfg.hidden_size, cfg.rwkv_attention_size
        super().__init__(h, (3, self.width))  # numerator, denominator, exponent
        self.mix_key, self.mix_value, self.mix_receptance = (nn.Parameter(torch.zeros(h)) for _ in range(3))
        self.key, self.value, self.receptance = (nn.Linear(h, self.width, bias=False) for _ in range(3))
        self.time_decay = nn.Parameter(torch.zeros(self.width))
        self.time_first = nn.Parameter(torch.zeros(self.width))
        self.out_proj = nn.Linear(self.width, h, bias=False)

    def recurrence(self, u: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The time mix over u [S, L, 2 * hidden] from ``state`` [S, 3, width]: r * wkv [S, L, width] and the state
        after (zeros are a fresh state: an exponent of 0 over a numerator and denominator of 0)."""
        s, length = u.shape[:2]
        k = self.key(self.mix(u, self.mix_key)).float().view(s, length, -1)
        v = self.value(self.mix(u, self.mix_value)).float().view(s, length, -1)
        r = torch.sigmoid(self.receptance(self.mix(u, self.mix_receptance))).view(s, length, -1)
        decay, first = -torch.exp(self.time_decay.float()), self.time_first.float()
        num, den, top = state.unbind(1)
        out = []
        for i in range(length):
            kt, vt = k[:, i], v[:, i]
            m = torch.maximum(top, kt + first)
            e1, e2 = torch.exp(top - m), torch.exp(kt + first - m)
            out.append((e1 * num + e2 * vt) / (e1 * den + e2))
            m = torch.maximum(top + decay, kt)
            e1, e2 = torch.exp(top + decay - m), torch.exp(kt - m)
            num, den, top = e1 * num + e2 * vt, e1 * den + e2, m
        return r * torch.stack(out, dim=1).to(r.dtype), torch.stack([num, den, top], dim=1)


class RwkvChannelMix(_Shifted):
    def __init__(self, cfg: ModelConfig, layer: int):  # (``layer``: the mixers' one signature)
        h, inner = cfg.hidden_size, cfg.intermediate_size
        super().__init__(h, (0,))  # the previous token's input alone
        self.width = h
        self.mix_key, self.mix_receptance = nn.Parameter(torch.zeros(h)), nn.Parameter(torch.zeros(h))
        self.key = nn.Linear(h, inner, bias=False)
        self.receptance = nn.Linear(h, h, bias=False)
        self.out_proj = nn.Linear(inner, h, bias=False)

    def forward(self, x, rope: RotaryStep | None, attn: AttentionBackend, meta: AttentionMetadata,
                kv_cache: list, bf16: bool = False, rows: torch.Tensor | None = None, tokens: int | None = None):
        """As the time mix's, the receptance's gate after ``out_proj`` (its rows [T, 2 * hidden]: gate, then
        relu(key)^2)."""
        t = x.shape[0] if tokens is None else tokens
        y = self.run_sequences(meta, x[:t], [], self.width + self.key.out_features)
        y = y if rows is None else y[rows]
        gate, inner = y.split([self.width, self.key.out_features], dim=-1)
        return gate * self.out_proj(inner)

    def recurrence(self, u: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[S, L, hidden + inner]: sigmoid(receptance) and relu(key)^2 of u [S, L, 2 * hidden]; the (empty) state."""
        s, length = u.shape[:2]
        inner = torch.square(torch.relu(self.key(self.mix(u, self.mix_key))))
        gate = torch.sigmoid(self.receptance(self.mix(u, self.mix_receptance)))
        return torch.cat([gate, inner], dim=-1).view(s, length, -1), state
