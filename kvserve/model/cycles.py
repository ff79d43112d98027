"""Two stacks of layers run in cycles over two residual streams (HRM's): the low stream goes through the low stack
``low`` times, each time reading the sum of the two streams, then the high stream through the high stack over that
sum, ``high`` times over; each pass ends with a weightless RMSNorm, and the last high pass's output is the model's.
The decoder holds every pass as layers of its own (``ModelConfig.stack_cycles``: the passes unrolled, each with its
own K/V, the weights of a stack's layers repeated); this module keeps the streams between them."""

from __future__ import annotations

import torch
from torch import nn

from kvserve.model.attention import rms_unweighted
from kvserve.model.config import ModelConfig

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
        """After ``layer``: where it ends a pass, the pass's normed output into its stream and the next pass's input (the
        two streams' sum) as the stream the layers go on with; as given otherwise."""
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
