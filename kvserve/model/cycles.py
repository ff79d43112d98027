"""Two stacks of layers run in cycles over two residual streams (HRM's): the low stream goes through the low stack
``low`` times, each time reading the sum of the two streams, then the high stream through the high stack over that
sum, ``high`` times over; each pass ends with a weightless RMSNorm, and the last high pass's output is the model's.
The decoder holds every pass as layers of its own (``ModelConfig.stack_cycles``: the passes unrolled, each with its
own K/V, the weights of a stack's layers repeated); this module keeps the streams between them. Dory's layers looped
(``RecurrentLoops``) are unrolled alike."""

from __future__ import annotations

import torch
from torch import nn

from kvserve.model.attention import rms_unweighted
from kvserve.model.config import ModelConfig
from kvserve.model.layers import L2Norm

Streams = tuple[torch.Tensor, torch.Tensor]  # (low, high)


class StackCycles(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        assert cfg.stack_cycles is not None
        self.per_stack, high, self.low = cfg.stack_cycles
        self.layers = self.per_stack * high * (self.low + 1)
        self.eps = cfg.rms_norm_eps
        self.low_init = nn.Parameter(torch.zeros(cfg.hidden_size))  # the low stream's start, every token's

    def start(self, h: torch.Tensor) -> tuple[torch.Tensor, Streams]:
        """The first pass's input from the embeddings ``h`` (the high stream's start), and the streams."""
        low = self.low_init.to(h.dtype).expand_as(h)
        return low + h, (low, h)

    def after(self, layer: int, h: torch.Tensor, delta: torch.Tensor | None,
              streams: Streams) -> tuple[torch.Tensor, torch.Tensor | None, Streams]:
        """After ``layer``: where it ends a pass, the pass's normed output into its stream and the next pass's input
        (the two streams' sum) as the stream the layers go on with; as given otherwise."""
        if (layer + 1) % self.per_stack:
            return h, delta, streams
        out = rms_unweighted(h if delta is None else h + delta, self.eps)
        if layer + 1 == self.layers:  # the last high pass: the model's output (its rows may be the sampled ones alone)
            return out, None, streams
        low, high = streams
        if (layer // self.per_stack) % (self.low + 1) == self.low:  # a high pass
            high = out
        else:
            low = out
        return low + high, None, (low, high)


class RecurrentLoops(nn.Module):
    """Dory's looped layers (``ModelConfig.recurrent_loops``: unrolled, each loop's K/V its own): before each loop the
    stream is L2-normed and added to the normed stream the input layers gave."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        assert cfg.recurrent_loops is not None
        self.first, self.looped, self.loops = cfg.recurrent_loops
        self.norm = L2Norm(cfg.rms_norm_eps)

    def start(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.first:
            return h, None
        entry = self.norm(h)  # no input layers: the first loop starts from the embeddings
        return self.norm(h) + entry, entry

    def after(self, layer: int, h: torch.Tensor, delta: torch.Tensor | None,
              entry: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        end = layer + 1
        if end < self.first or end >= self.first + self.looped * self.loops or (end - self.first) % self.looped:
            return h, delta, entry
        h = h if delta is None else h + delta
        if end == self.first:
            entry = self.norm(h)
        return self.norm(h) + entry, None, entry
