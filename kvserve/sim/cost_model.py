"""The roofline cost of one scheduled step on a device, from the batch the real scheduler made.

A step's time is a fixed overhead, a per-sequence cost, and the larger of compute time
(FLOPs of the linear layers and attention at the device's achievable FLOP/s for the
precision) and memory time (weights and KV read, KV written, at achievable bandwidth) — or
their sum on a CPU, where the same cores do both — plus the tensor-parallel all-reduces
over the interconnect. Prefill is compute-bound and decode memory-bound because the
arithmetic says so, not by a rule.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvserve.sim.hardware import Hardware
from kvserve.sim.models import BYTES, ModelSpec


@dataclass(frozen=True)
class ChunkShape:
    """What the cost needs to know of a scheduled chunk: where it starts, its length, whether it samples."""

    start: int
    num_tokens: int
    sample: bool = True


@dataclass
class StepCost:
    linear_flops: float = 0.0
    attention_flops: float = 0.0
    weight_bytes: float = 0.0
    kv_bytes: float = 0.0
    compute_s: float = 0.0
    memory_s: float = 0.0
    comm_s: float = 0.0
    overhead_s: float = 0.0
    seconds: float = 0.0

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "memory"


@dataclass
class Roofline:
    model: ModelSpec
    hw: Hardware
    weights: str = "bf16"  # bf16 | fp8 | fp4 (nvfp4) | fp32
    kv: str = "bf16"  # bf16 | fp8 | fp32
    tp: int = 1  # tensor-parallel degree: FLOPs and bytes split, all-reduces added

    @property
    def compute_precision(self) -> str:
        """Quantized weights run on matching tensor cores where the device has them (W8A8, W4A4);
        elsewhere they are dequantized to 16-bit (weight-only): the bytes shrink, the FLOP rate does not."""
        if self.weights in ("fp8", "fp4") and self.hw.native(self.weights):
            return self.weights
        if self.weights == "fp32" or not (self.hw.native("bf16") or self.hw.native("fp8")):
            return "fp32" if self.hw.native("fp32") else "bf16"
        return "bf16"

    def _attention_precision(self) -> str:
        return "fp32" if self.compute_precision == "fp32" else "bf16"

    def step(self, chunks: Iterable[ChunkShape]) -> StepCost:
        m, hw = self.model, self.hw
        chunks = list(chunks)
        c = StepCost()
        if not chunks:
            return c
        tokens = sum(ch.num_tokens for ch in chunks)
        sampled = sum(1 for ch in chunks if ch.sample)
        # linear layers: 2 FLOPs per active parameter per token; lm_head only at sampled rows
        c.linear_flops = 2.0 * m.layer_params(True) * tokens + 2.0 * m.hidden * m.vocab * sampled
        # attention: each query at position p meets p + 1 keys (QK^T and PV: 4 FLOPs per head-dim)
        pairs = sum(ch.num_tokens * ch.start + ch.num_tokens * (ch.num_tokens + 1) / 2 for ch in chunks)
        c.attention_flops = 4.0 * m.layers * m.heads * m.head_dim * pairs
        # weights: every dense weight once per step; for MoE the experts the batch's tokens touch
        w = BYTES[self.weights]
        if m.experts:
            touched = m.experts * (1 - (1 - m.experts_per_token / m.experts) ** tokens)
            per_expert = 3 * m.hidden * m.expert_intermediate
            layer_bytes = (m.attn_params_per_layer + touched * per_expert
                           + 3 * m.hidden * m.shared_expert_intermediate + m.hidden * m.experts) * w
            c.weight_bytes = m.layers * layer_bytes
        else:
            c.weight_bytes = m.layer_params(False) * w
        emb = BYTES["fp32"] if self.weights == "fp32" else BYTES["bf16"]
        if sampled:
            c.weight_bytes += m.hidden * m.vocab * emb
        # KV: each chunk reads its whole context once (flash-style) and writes its new tokens
        kvb = m.kv_bytes_per_token(self.kv)
        c.kv_bytes = kvb * sum(ch.start + ch.num_tokens for ch in chunks) + kvb * tokens

        tp = max(1, self.tp)
        c.compute_s = (c.linear_flops / (hw.peak_flops(self.compute_precision) * hw.mfu)
                       + c.attention_flops / (hw.peak_flops(self._attention_precision()) * (hw.attn_mfu or hw.mfu))) / tp
        c.memory_s = (c.weight_bytes + c.kv_bytes) / (hw.hbm_tbps * 1e12 * hw.mbu) / tp
        if tp > 1:  # two all-reduces of the activations per layer (ring: 2 (tp-1)/tp of the data)
            size = tokens * m.hidden * BYTES["bf16"]
            per = 2 * (tp - 1) / tp * size / (hw.interconnect_gbps * 1e9) + hw.allreduce_latency_s
            c.comm_s = 2 * m.layers * per
        c.overhead_s = hw.overhead_s + hw.per_seq_s * len(chunks)
        work = max(c.compute_s, c.memory_s) if hw.overlap else c.compute_s + c.memory_s
        c.seconds = c.overhead_s + work + c.comm_s
        return c

    def transfer_seconds(self, nbytes: float) -> float:
        """Copying KV between device and host memory."""
        return nbytes / (self.hw.host_link_gbps * 1e9)
