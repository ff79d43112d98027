"""EngineConfig: every engine knob, defined once and shared by the CLI, server and Python API.

Flag names follow vLLM's where vLLM has the same knob (``--max-num-seqs`` and so on).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields
from typing import Any

from kvserve.errors import InvalidArgumentError

DTYPES = ("auto", "bfloat16", "float16", "float32", "float64")


@dataclass
class EngineConfig:
    model: str | None = field(default=None, metadata={"help": "a Hugging Face folder or a .gguf file; default: embedded SmolLM2-135M-Instruct"})
    dtype: str = field(default="auto", metadata={"help": "weights and KV cache dtype; auto: bfloat16 on CUDA and on CPUs "
                                                  "with native bf16 (AVX512-BF16/AMX), else float32", "choices": DTYPES})
    device: str = field(default="auto", metadata={"help": "cpu, cuda, or auto (cuda when available)"})
    block_size: int = field(default=16, metadata={"help": "tokens per KV cache block"})
    kv_cache_memory_gb: float | None = field(default=None, metadata={"help": "KV cache size in GiB (default: from free memory, at most 4)"})
    num_kv_blocks: int | None = field(default=None, metadata={"help": "exact KV pool size in blocks (overrides --kv-cache-memory-gb)"})
    kv_cache_dtype: str = field(default="auto", metadata={"help": "how the KV cache stores K and V: auto (in the "
                                "model's --dtype); other KV pools register by name (kvserve.attention.register_kv_pool)"})
    attention_backend: str = field(default="gather-sdpa", metadata={"help": "attention implementation: gather-sdpa "
                                   "(gathers each sequence's KV through its block table, then torch SDPA); others "
                                   "register by name (kvserve.attention.register_attention_backend)"})
    max_num_seqs: int = field(default=128, metadata={"help": "most sequences in one step"})
    max_num_batched_tokens: int = field(default=2048, metadata={"help": "token budget of one step (chunked prefill fills it)"})
    prefill_step_factor: float = field(default=1.5, metadata={"help": "while sequences decode, a step carrying the prefill "
                                       "of a long prompt may cost at most this many decode-only steps (learned from measured "
                                       "step times), so streams stay smooth under long-prompt bursts; 0: off"})
    metered_prefill_min_tokens: int = field(default=1024, metadata={"help": "prompts with at most this many tokens left to "
                                            "prefill go in whole, outside the --prefill-step-factor budget"})
    enable_prefix_caching: bool = field(default=True, metadata={"help": "reuse the KV of shared prompt prefixes (radix tree)"})
    schedule_policy: str = field(default="lpm", metadata={"help": "order of waiting requests: fcfs; lpm (longest cached "
                                 "prefix first); dfs-weight (SGLang's, keeps one branch of the tree hot)",
                                 "choices": ("fcfs", "lpm", "dfs-weight")})
    starvation_timeout_s: float = field(default=10.0, metadata={"help": "a request waiting longer than this goes first, "
                                        "whatever the cache-aware order"})
    kv_offload_memory_gb: float = field(default=0.0, metadata={"help": "host-memory tier for evicted KV blocks, GiB (0: off)"})
    kv_offload_dir: str | None = field(default=None, metadata={"help": "directory of a disk tier for evicted KV blocks "
                                       "(kept across restarts)"})
    kv_offload_disk_gb: float = field(default=10.0, metadata={"help": "size bound of the disk tier, GiB"})
    speculative_method: str | None = field(default=None, metadata={"help": "speculative decoding: ngram (prompt "
                                           "lookup, no second model) or draft (--speculative-model); default off",
                                           "choices": ("ngram", "draft")})
    num_speculative_tokens: int = field(default=5, metadata={"help": "most tokens drafted per request and step"})
    adaptive_speculation: bool = field(default=True, metadata={"help": "draft only as many tokens per request as "
                                       "the measured acceptance and the step-time model say pay (down to none at "
                                       "large batches); --no-adaptive-speculation always drafts the maximum"})
    ngram_min: int = field(default=2, metadata={"help": "shortest tail that prompt lookup matches"})
    ngram_max: int = field(default=4, metadata={"help": "longest tail that prompt lookup matches (tried first)"})
    speculative_model: str | None = field(default=None, metadata={"help": "draft model for --speculative-method "
                                          "draft: a Hugging Face folder or .gguf with the target's tokenizer"})
    grammar_cache_size: int = field(default=128, metadata={"help": "compiled grammars (JSON schemas, regexes, ...) "
                                    "kept for reuse, least recently used evicted first"})
    grammar_compile_timeout_s: float = field(default=10.0, metadata={"help": "a grammar that takes longer to compile "
                                             "is refused (400); compiles run in a child process, killed past this; "
                                             "0: compile in the engine process, unbounded"})
    max_model_len: int | None = field(default=None, metadata={"help": "context window (default: the model's, capped by the KV cache)"})
    seed: int = field(default=0, metadata={"help": "seed of the shared generator for unseeded sampling"})
    num_threads: int | None = field(default=None, metadata={"help": "torch CPU threads (default: all cores)"})

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise InvalidArgumentError(f"--{name.replace('_', '-')} must be at least 1", param=name)
        if self.dtype not in DTYPES:
            raise InvalidArgumentError(f"--dtype must be one of {', '.join(DTYPES)}", param="dtype")
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb <= 0:
            raise InvalidArgumentError("--kv-cache-memory-gb must be positive", param="kv_cache_memory_gb")
        if self.prefill_step_factor != 0 and self.prefill_step_factor < 1:
            raise InvalidArgumentError("--prefill-step-factor must be 0 (off) or at least 1", param="prefill_step_factor")
        if self.kv_offload_memory_gb < 0 or self.kv_offload_disk_gb <= 0:
            raise InvalidArgumentError("--kv-offload-memory-gb must be >= 0 and --kv-offload-disk-gb > 0",
                                       param="kv_offload_memory_gb")
        if (self.kv_offload_memory_gb or self.kv_offload_dir) and not self.enable_prefix_caching:
            raise InvalidArgumentError("the KV offload tiers keep prefix-cache blocks: they need prefix caching "
                                       "(drop --no-enable-prefix-caching)", param="kv_offload_memory_gb")
        if self.starvation_timeout_s <= 0:
            raise InvalidArgumentError("--starvation-timeout-s must be positive", param="starvation_timeout_s")
        self._check_speculation()
        if self.grammar_cache_size < 1:
            raise InvalidArgumentError("--grammar-cache-size must be at least 1", param="grammar_cache_size")
        if self.grammar_compile_timeout_s < 0:
            raise InvalidArgumentError("--grammar-compile-timeout-s must be >= 0", param="grammar_compile_timeout_s")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise InvalidArgumentError("--max-model-len must be at least 2", param="max_model_len")

    def _check_speculation(self) -> None:
        m = self.speculative_method
        if m not in (None, "ngram", "draft"):
            raise InvalidArgumentError("--speculative-method must be ngram or draft", param="speculative_method")
        if m == "draft" and not self.speculative_model:
            raise InvalidArgumentError("--speculative-method draft needs --speculative-model PATH", param="speculative_model")
        if self.speculative_model and m != "draft":
            raise InvalidArgumentError("--speculative-model is used only with --speculative-method draft",
                                       param="speculative_model")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise InvalidArgumentError("--num-speculative-tokens must be in [1, 16]", param="num_speculative_tokens")
        if not 1 <= self.ngram_min <= self.ngram_max <= 32:
            raise InvalidArgumentError("need 1 <= --ngram-min <= --ngram-max <= 32", param="ngram_min")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        for f in fields(cls):
            flag = "--" + f.name.replace("_", "-")
            if f.type in (bool, "bool"):
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=f.metadata.get("help"))
                continue
            kind = {"int": int, "float": float, "str": str}[str(f.type).split(" ")[0].replace("|", "").strip()]
            parser.add_argument(flag, type=kind, default=f.default, help=f.metadata.get("help"), choices=f.metadata.get("choices"))

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineConfig":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = set(kwargs) - known
        if unknown:
            raise InvalidArgumentError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
        return cls(**kwargs)
