"""The roofline cost of one scheduled step on a device, from the batch the real scheduler made.

A step's time is a fixed overhead, a per-sequence cost, and the larger of compute time
(FLOPs of the linear layers and attention at the device's achievable FLOP/s for the
precision) and memory time (weights and KV read, KV written, at achievable bandwidth) — or
their sum on a CPU, where the same cores do both — plus the tensor-parallel all-reduces
over the interconnect. Prefill is compute-bound and decode memory-bound because the
arithmetic says so, not by a rule.

On a GPU with an engine's cost terms (``kvserve.sim.engine_costs``) the fixed overhead is
replaced by that engine's host time (overlapped with the GPU or not), its kernel launches
(a CUDA graph or eager), and the efficiencies depend on the step's shape: GEMM efficiency on
its token count, KV-read efficiency on the KV it reads, and mixed prefill+decode steps pay
an interference term.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvserve.sim.engine_costs import EngineCosts
from kvserve.sim.hardware import Hardware
from kvserve.sim.models import BYTES, ModelSpec


@dataclass(frozen=True)
class ChunkShape:
    """What the cost needs to know of a scheduled chunk: where it starts, its length, whether it samples."""

    start: int
    num_tokens: int
    sample: bool = True
    decode: bool = False  # a running sequence's next token(s), not a prompt chunk


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
    host_s: float = 0.0  # the engine's CPU time for this step (part of overhead_s unless overlapped)
    launch_s: float = 0.0  # kernel launches: one graph replay, or every layer's kernels
    graph_batch: int | None = None  # the captured CUDA-graph size this decode step padded to
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
    costs: EngineCosts | None = None  # an engine's cost terms (GPU); None: the hardware's flat ones

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
        if self.costs is not None and hw.overlap:
            return self._engine_step(c, chunks, tokens, kvb, tp)
        c.compute_s = (c.linear_flops / (hw.peak_flops(self.compute_precision) * hw.mfu)
                       + c.attention_flops / (hw.peak_flops(self._attention_precision()) * (hw.attn_mfu or hw.mfu))) / tp
        c.memory_s = (c.weight_bytes + c.kv_bytes) / (hw.hbm_tbps * 1e12 * hw.mbu) / tp
        c.comm_s = self._comm_seconds(tokens, tp)
        c.overhead_s = hw.overhead_s + hw.per_seq_s * len(chunks)
        work = max(c.compute_s, c.memory_s) if hw.overlap else c.compute_s + c.memory_s
        c.seconds = c.overhead_s + work + c.comm_s
        return c

    def _comm_seconds(self, tokens: int, tp: int, latency_s: float | None = None) -> float:
        """Two all-reduces of the activations per layer (ring: 2 (tp-1)/tp of the data)."""
        if tp <= 1:
            return 0.0
        size = tokens * self.model.hidden * BYTES["bf16"]
        latency = self.hw.allreduce_latency_s if latency_s is None else latency_s
        per = 2 * (tp - 1) / tp * size / (self.hw.interconnect_gbps * 1e9) + latency
        return 2 * self.model.layers * per

    def _engine_step(self, c: StepCost, chunks: list[ChunkShape], tokens: int, kvb: float, tp: int) -> StepCost:
        """A GPU step under an engine's cost terms (see kvserve/sim/engine_costs.py)."""
        m, hw, ec = self.model, self.hw, self.costs
        assert ec is not None
        decode_only = all(ch.decode for ch in chunks)
        mixed = not decode_only and any(ch.decode for ch in chunks)
        gemm_tokens = tokens
        if decode_only:
            c.graph_batch = ec.graph_batch(len(chunks))
            if c.graph_batch is not None:  # a padded graph computes its padding rows too
                gemm_tokens = tokens * c.graph_batch // len(chunks)
        c.launch_s = ec.launch_graph_s if c.graph_batch is not None else ec.launch_eager_per_layer_s * m.layers
        linear = c.linear_flops * gemm_tokens / tokens
        c.compute_s = (linear / (hw.peak_flops(self.compute_precision) * hw.mfu * ec.gemm_efficiency(gemm_tokens))
                       + c.attention_flops / (hw.peak_flops(self._attention_precision())
                                              * (hw.attn_mfu or hw.mfu) * ec.gemm_scale)) / tp
        kv_read = kvb * sum(ch.start + ch.num_tokens for ch in chunks)
        kv_tokens = kv_read / kvb if kvb else 0.0
        bw = hw.hbm_tbps * 1e12 * hw.mbu
        c.memory_s = ((c.weight_bytes + c.kv_bytes - kv_read) / (bw * ec.bandwidth_scale)
                      + kv_read / (bw * ec.kv_efficiency(kv_tokens))) / tp
        c.comm_s = self._comm_seconds(tokens, tp, ec.allreduce_s)
        work = max(c.compute_s, c.memory_s)
        if mixed:
            work += ec.interference * min(c.compute_s, c.memory_s)
        gpu = c.launch_s + work + c.comm_s
        c.host_s = ec.host_step_s + ec.host_per_seq_s * len(chunks)
        c.seconds = max(gpu, c.host_s) if ec.overlap_host else gpu + c.host_s
        c.overhead_s = c.seconds - work - c.comm_s
        return c

    def transfer_seconds(self, nbytes: float) -> float:
        """Copying KV between device and host memory."""
        return nbytes / (self.hw.host_link_gbps * 1e9)
