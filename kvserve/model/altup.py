"""Gemma 3n's layer parts beyond Gemma 4's: several residual streams kept side by side (AltUp, ``altup_streams``: a
layer runs on one active stream, predicts every stream from all of them before and corrects them by what it computed
after, both mixes chosen per token by a small router), a low-rank residual branch beside attention (LAuReL,
``laurel_rank``), and the layer built of them (``altup_layer_forward``); the streams made from the embedding before
the first layer and folded back into one after the last (``AltUpStreams``). (The MLP gate's activation sparsity is
``kvserve.model.mlp.gaussian_topk``.)"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from kvserve.model.layers import RMSNorm


def _rescaled(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``x`` scaled to the RMS ``target`` [T, 1] (its own RMS floored, so a zero row stays finite)."""
    return x * target / torch.sqrt(x.pow(2).mean(-1, keepdim=True).clamp(min=1e-5))


class AltUpStreams(nn.Module):
    """The extra streams from the embedding (one projection each, rescaled to the embedding's RMS) and back: each
    projected again, rescaled to stream 0's RMS, and all averaged."""

    def __init__(self, hidden: int, streams: int):
        super().__init__()
        self.expand = nn.ModuleList(nn.Linear(hidden, hidden, bias=False) for _ in range(streams - 1))
        self.collapse = nn.ModuleList(nn.Linear(hidden, hidden, bias=False) for _ in range(streams - 1))

    def spread(self, h: torch.Tensor) -> torch.Tensor:
        """[streams, T, hidden] from the embeddings [T, hidden]."""
        target = h.pow(2).mean(-1, keepdim=True).sqrt()
        return torch.stack([h, *(_rescaled(p(h), target) for p in self.expand)])

    def fold(self, streams: torch.Tensor) -> torch.Tensor:
        """[T, hidden]: the streams' mean, each beyond the first projected and rescaled to the first's RMS."""
        target = streams[0].pow(2).mean(-1, keepdim=True).sqrt()
        parts = [streams[0], *(_rescaled(p(s), target) for p, s in zip(self.collapse, streams[1:]))]
        return torch.stack(parts).mean(0)


class AltUp(nn.Module):
    """One layer's stream mixing: a router reads a stream (RMS-normed, scaled by 1 / hidden) into a tanh per stream;
    from it, per token, the prediction coefficients (streams x streams) and the correction ones (a gain per stream)."""

    def __init__(self, hidden: int, streams: int, active: int, eps: float, correct_scale: bool):
        super().__init__()
        self.streams, self.active = streams, active
        self.router_norm = RMSNorm(hidden, eps)
        self.modality_router = nn.Linear(hidden, streams, bias=False)
        self.prediction_coefs = nn.Linear(streams, streams * streams, bias=False)
        self.correction_coefs = nn.Linear(streams, streams, bias=False)
        # the corrected active stream scaled per dim before it feeds the per-layer input's gate
        # (a checkpoint holds it whether or not its config applies it)
        self.correct_output_scale = nn.Parameter(torch.zeros(hidden))
        self.correct_scale = correct_scale
        self.input_scale = 1.0 / hidden

    def route(self, x: torch.Tensor) -> torch.Tensor:
        routed = self.modality_router(self.router_norm(x) * torch.tensor(self.input_scale, dtype=x.dtype))
        return torch.tanh(routed.float()).to(x.dtype)

    def predict(self, streams: torch.Tensor) -> torch.Tensor:
        """Each stream plus the router's mix of all of them: pred[i] = s[i] + sum_j c[t, i, j] s[j]."""
        n = self.streams
        coefs = self.prediction_coefs(self.route(streams[self.active])).view(-1, n, n)  # [T, i, j]
        return streams + torch.einsum("tij,jth->ith", coefs, streams)

    def correct(self, predictions: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Each prediction plus the layer's innovation (its output less the active prediction), times a gain of
        1 + the router's coefficient for that stream."""
        gains = self.correction_coefs(self.route(out)) + 1.0  # [T, streams]
        innovation = out - predictions[self.active]
        return predictions + gains.t().unsqueeze(-1) * innovation

    def scaled(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.correct_output_scale if self.correct_scale else x


class Laurel(nn.Module):
    """LAuReL: x + norm(right(left(x))), a rank-``rank`` branch."""

    def __init__(self, hidden: int, rank: int, eps: float):
        super().__init__()
        self.linear_left = nn.Linear(hidden, rank, bias=False)
        self.linear_right = nn.Linear(rank, hidden, bias=False)
        self.post_laurel_norm = RMSNorm(hidden, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.post_laurel_norm(self.linear_right(self.linear_left(x)))


def altup_layer_forward(layer: Any, streams: torch.Tensor, rope: Any, attn: Any, meta: Any, kv_cache: Any,
                        rows: torch.Tensor | None, per_layer: torch.Tensor | None) -> tuple[torch.Tensor, None]:
    """A layer over the streams [n, T, hidden] (``DecoderLayer`` with ``altup``): the sandwich layout on the active
    stream's prediction, LAuReL's branch joining attention's output (the sum scaled by 1 / sqrt 2), the MLP, the
    correction of every stream, then the per-layer input's branch (read from the corrected active stream) added to
    every stream but the first. ``rows``: only those tokens leave the layer (every token's K/V is written)."""
    predictions = layer.altup.predict(streams)
    active = predictions[layer.altup.active]
    x = layer.input_layernorm(active)
    a = layer.self_attn(x, rope, attn, meta, kv_cache, False, rows, x.shape[0])
    if rows is not None:
        predictions, active, x = predictions[:, rows], active[rows], x[rows]
        per_layer = None if per_layer is None else per_layer[rows]
        if not rows.numel():
            return predictions, None
    out = active + layer.attn_out_norm(a)
    if layer.laurel is not None:
        out = (out + layer.laurel(x)) / math.sqrt(2.0)
    out = out + layer.mlp_out_norm(layer.mlp(layer.post_attention_layernorm(out)))
    corrected = layer.altup.correct(predictions, out)
    if per_layer is not None:
        first = layer.altup.scaled(corrected[layer.altup.active])
        gated = layer.per_layer_act(layer.per_layer_gate(first)) * per_layer
        branch = layer.per_layer_norm(layer.per_layer_proj(gated))
        corrected[1:] += branch
    return corrected, None
