"""Engine profiles: the knobs of the one scheduler and KV manager set the way each stack sets them.

A profile is not a different scheduler: ``static`` is the scheduler with batch-then-wait on,
``vllm`` and ``sglang`` differ in policy and budget, ``trtllm`` in precision, speculation and
prefill/decode disaggregation, ``llamacpp`` in slots and unpaged KV (one block per slot).
What a step costs on a GPU differs per engine too: host overhead and its overlap, CUDA graphs,
kernel efficiencies (``kvserve.sim.engine_costs``, chosen by ``engine``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvserve.config import CacheConfig, KVServeConfig, SchedulerConfig
from kvserve.errors import InvalidArgumentError
from kvserve.kv.layout import EIGHT_BIT_KV_DTYPES
from kvserve.sim.engine_costs import EngineCosts, costs_for


@dataclass(frozen=True)
class EngineProfile:
    name: str
    description: str
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    chunked_prefill: bool = True
    mixed_prefill: bool = True  # decodes share steps with prefill chunks (False: SGLang's prefill-only steps)
    # a prefix computed in a step serves the step's other requests on it (kvserve); the others wait a step
    # for it, as SGLang's in-batch prefix check makes them (and as the validation was fitted)
    share_prefix_in_step: bool = False
    static_batching: bool = False
    prefix_caching: bool = True
    schedule_policy: str = "fcfs"
    weights: str = "bf16"
    kv: str = "bf16"
    # speculative decoding (MTP / draft): k tokens verified per decode, each accepted with this probability
    spec_tokens: int = 0
    acceptance: float = 0.0
    draft_params_b: float = 0.0  # a separate draft model's size (billions), for the memory footprint
    disaggregated: bool = False  # prefill and decode on separate device pools (twice the devices)
    slots: int | None = None  # llama.cpp: a fixed number of slots, each reserving its whole context
    block_size: int = 16
    prefill_step_factor: float = 0.0
    # KV cache sized as mem_util of the memory left after weights (TensorRT-LLM's
    # free_gpu_memory_fraction, default 0.9) rather than mem_util of all memory less the weights
    kv_memory_of_free: bool = False
    engine: str = "vllm"  # whose cost terms a step pays (kvserve.sim.engine_costs)
    costs_override: EngineCosts | None = None  # cost terms to use instead of the engine's (fitting, tests)

    @property
    def costs(self) -> EngineCosts:
        return self.costs_override or costs_for(self.engine)

    @property
    def tokens_per_decode_step(self) -> float:
        """Expected tokens a decode step emits: 1 + accepted drafts (a geometric run, capped at k)."""
        if not self.spec_tokens:
            return 1.0
        a, k = self.acceptance, self.spec_tokens
        return (1 - a ** (k + 1)) / (1 - a) if a < 1 else k + 1.0

    def with_(self, **changes) -> "EngineProfile":
        return replace(self, **changes)

    def to_config(self) -> KVServeConfig:
        """The engine configuration this profile stands for: what the simulated engine runs with."""
        return KVServeConfig(
            cache=CacheConfig(block_size=self.block_size, enable_prefix_caching=self.prefix_caching,
                              kv_cache_dtype=self.kv if self.kv in EIGHT_BIT_KV_DTYPES else "auto"),
            scheduler=SchedulerConfig(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                                      chunked_prefill=self.chunked_prefill, mixed_prefill=self.mixed_prefill,
                                      static_batching=self.static_batching,
                                      schedule_policy=self.schedule_policy if self.prefix_caching else "fcfs",
                                      prefill_step_factor=self.prefill_step_factor,
                                      share_prefix_in_step=self.share_prefix_in_step))


PROFILES: dict[str, EngineProfile] = {
    "kvserve": EngineProfile("kvserve", "kvserve's defaults: continuous batching, 2048-token steps, radix cache, "
                             "lpm, time-capped prefill of long prompts", max_num_seqs=128, max_num_batched_tokens=2048,
                             schedule_policy="lpm", prefill_step_factor=1.5, share_prefix_in_step=True,
                             engine="kvserve"),
    "static": EngineProfile("static", "batch-then-wait: a batch of whole prompts runs until every sequence ends",
                            max_num_seqs=64, max_num_batched_tokens=1 << 20, chunked_prefill=False,
                            static_batching=True, prefix_caching=False, engine="static"),
    "vllm": EngineProfile("vllm", "vLLM V1: continuous batching, chunked prefill (8192), block-hash prefix "
                          "cache, FCFS; host scheduling between steps, CUDA graphs up to 512", engine="vllm"),
    # SGLang runs a step of new prefill whenever it can form one and decodes otherwise; it mixes
    # the two only with --enable-mixed-chunk (off by default): https://docs.sglang.io/advanced_features/server_arguments.html
    "sglang": EngineProfile("sglang", "SGLang: radix cache, longest-prefix-match order, chunked prefill (8192) in "
                            "prefill-only steps; overlap scheduler, CUDA graphs up to 256", schedule_policy="lpm",
                            mixed_prefill=False, engine="sglang"),
    # TensorRT-LLM's LLM API defaults: max_batch_size 2048, max_num_tokens 8192
    "trtllm": EngineProfile("trtllm", "TensorRT-LLM: in-flight batching (2048 sequences), FP8 weights and KV, MTP (3 tokens, "
                            "acceptance 0.7); overlap scheduler, CUDA graphs up to 8192", weights="fp8", kv="fp8", spec_tokens=3,
                            acceptance=0.7, engine="trtllm", max_num_seqs=2048, kv_memory_of_free=True),
    "trtllm-disagg": EngineProfile("trtllm-disagg", "TensorRT-LLM with prefill/decode disaggregation (two pools)",
                                   weights="fp8", kv="fp8", spec_tokens=3, acceptance=0.7, disaggregated=True,
                                   engine="trtllm", kv_memory_of_free=True),
    "llamacpp": EngineProfile("llamacpp", "llama.cpp server: 4 slots, each reserving n_ctx/4 of unpaged KV, "
                              "2048-token batches, no cross-request prefix cache", max_num_seqs=4,
                              max_num_batched_tokens=2048, prefix_caching=False, slots=4, engine="llamacpp"),
}


def get_profile(name: str) -> EngineProfile:
    if name not in PROFILES:
        raise InvalidArgumentError(f"unknown engine profile {name!r}; known: {', '.join(PROFILES)}")
    return PROFILES[name]
