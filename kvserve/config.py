"""The configuration: one object with a part per concern, defined once.

``KVServeConfig`` holds every knob in nested parts (model, cache, scheduler, speculation,
structured output, server). The same object generates the CLI flags (names follow vLLM's where
vLLM has the same knob), takes the Python API's flat keyword arguments (``LLM(max_num_seqs=8)``),
is handed whole to the engine process, and a simulator profile maps onto it. A new setting is one
field in one part: its flag, its keyword and its place in every process follow.

Fields whose metadata says ``cli: False`` are internal (tests, baselines, the simulator) and get
no flag. No torch here.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from dataclasses import dataclass, field, fields
from typing import Any

from kvserve.cpu_bind import resolve_cpu_bind
from kvserve.errors import InvalidArgumentError

DTYPES = ("auto", "bfloat16", "float16", "float32", "float64")
QUANTIZATIONS = ("auto", "none", "int8", "int4")
LOAD_FORMATS = ("auto", "dummy")
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")  # vLLM's names; the KV pools register them
SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight")
SPECULATIVE_METHODS = ("ngram", "draft")
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral", "none")
DEFAULT_MAX_REQUEST_BYTES = 8 << 20  # a full 128K-token prompt as text is ~0.5-3 MB of JSON


def _check(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise InvalidArgumentError(message, param=param)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass
class ModelOptions:
    """Which model, in what precision, on which device."""

    model: str | None = field(default=None, metadata={"help": "a Hugging Face folder or a .gguf file; default: embedded SmolLM2-135M-Instruct"})
    dtype: str = field(default="auto", metadata={"help": "weights and KV cache dtype; auto: bfloat16 on CUDA and on CPUs "
                                                  "with native bf16 (AVX512-BF16/AMX), else float32", "choices": DTYPES})
    device: str = field(default="auto", metadata={"help": "cpu, cuda, or auto (cuda when available)"})
    max_model_len: int | None = field(default=None, metadata={"help": "context window (default: the model's, capped by the KV cache)"})
    quantization: str = field(default="auto", metadata={"help": "weight-only quantized linear layers on CPU (blocks of 32, native kernels): auto keeps a GGUF's Q8_0/Q4_0/Q4_1 weights as stored and other weights dense; none dequantizes everything to --dtype; int8 / int4 quantize every linear layer at load (Q8_0 / Q4_1)", "choices": QUANTIZATIONS})  # noqa: E501
    load_format: str = field(default="auto", metadata={"help": "auto: read the model's weights; dummy: random "
                             "weights (seeded by --seed) of the shapes config.json implies, for a folder that holds "
                             "only config.json and a tokenizer: any size can be served and benchmarked without its "
                             "weights (outputs are meaningless)", "choices": LOAD_FORMATS})
    seed: int = field(default=0, metadata={"help": "seed of the shared generator for unseeded sampling (and of "
                      "--load-format dummy's weights)"})
    num_threads: int | None = field(default=None, metadata={"help": "torch CPU threads (default: all cores, or --cpu-bind's)"})  # noqa: E501
    cpu_bind: str | None = field(default=None, metadata={"help": "pin the engine's threads: a CPU list (0-7,16), numa:N (NUMA node N's CPUs), or with --replicas auto (each replica its own cores, node by node); default: unpinned (docs/scale-out.md)"})  # noqa: E501
    deterministic: bool | None = field(default=None, metadata={"tristate": True, "help": "a token's logits never depend on the batch, chunking, speculation or prefix hits (docs/determinism.md); default: on except on AMX CPUs, where it turns the bf16 AMX paths off"})  # noqa: E501

    def __post_init__(self) -> None:
        _check(self.dtype in DTYPES, f"--dtype must be one of {', '.join(DTYPES)}", "dtype")
        _check(self.quantization in QUANTIZATIONS, f"--quantization must be one of {', '.join(QUANTIZATIONS)}",
               "quantization")
        _check(self.load_format in LOAD_FORMATS, f"--load-format must be one of {', '.join(LOAD_FORMATS)}",
               "load_format")
        _check(self.max_model_len is None or self.max_model_len >= 2, "--max-model-len must be at least 2",
               "max_model_len")
        resolve_cpu_bind(self.cpu_bind)  # a bad list or node: one line, before anything starts


@dataclass
class CacheConfig:
    """The paged KV cache: its size and layout, the prefix cache, the offload tiers, the attention kernel."""

    block_size: int = field(default=16, metadata={"help": "tokens per KV cache block"})
    kv_cache_memory_gb: float | None = field(default=None, metadata={"help": "KV cache size in GiB (default: room for --max-num-seqs sequences of --max-model-len tokens, capped by free memory: a quarter of it and 4 GiB on the CPU; the log says what was chosen)"})
    num_kv_blocks: int | None = field(default=None, metadata={"help": "exact KV pool size in blocks (overrides --kv-cache-memory-gb)"})
    enable_prefix_caching: bool = field(default=True, metadata={"help": "reuse the KV of shared prompt prefixes (radix tree)"})
    kv_offload_memory_gb: float = field(default=0.0, metadata={"help": "host-memory tier for evicted KV blocks, GiB (0: off)"})
    kv_offload_dir: str | None = field(default=None, metadata={"help": "directory of a disk tier for evicted KV blocks "
                                       "(kept across restarts)"})
    kv_offload_disk_gb: float = field(default=10.0, metadata={"help": "size bound of the disk tier, GiB"})
    kv_offload_dir_shared: bool = field(default=False, metadata={"help": "other replicas share --kv-offload-dir "
                                        "(a common mount): save each block to it once computed, not only when evicted",
                                        "store_true": True})
    kv_offload_url: str | None = field(default=None, metadata={"help": "redis://HOST:PORT/DB: a KV tier in Redis "
                                       "shared by replicas (each block saved once computed; Redis evicts: run it with "
                                       "maxmemory and allkeys-lru)"})
    kv_cache_dtype: str = field(default="auto", metadata={"help": "how the KV cache stores K and V: auto (in the "
                                "model's --dtype; bfloat16 for a float32 model on an AMX CPU, where prefill attends in "
                                "bf16); bfloat16; fp8 (= fp8_e4m3), fp8_e5m2, int8: 8 bits with scales (per head; "
                                "int8: per channel) computed at start-up (half of bf16's bytes, a quarter of float32's); other KV pools "
                                "register by name (kvserve.attention.register_kv_pool)", "choices": KV_CACHE_DTYPES})
    attention_backend: str = field(default="auto", metadata={"help": "attention implementation: auto (paged where "
                                   "its native CPU kernel runs, else gather-sdpa), paged (reads KV in place through the "
                                   "block tables), gather-sdpa (gathers each sequence's KV, then torch SDPA); others "
                                   "register by name (kvserve.attention.register_attention_backend)"})
    role: str = field(default="both", metadata={"help": "disaggregated prefill (docs/scale-out.md): prefill (computes "
                      "prompts and their first token, sends their KV on), decode (takes requests whose KV a prefill "
                      "replica sends; listens on --kv-transfer-port), both", "choices": ("both", "prefill", "decode")})
    kv_connector: str = field(default="tcp", metadata={"help": "how KV goes from prefill to decode replicas: tcp "
                              "(streamed as chunks complete), shared-tier (through --kv-offload-url or a shared "
                              "--kv-offload-dir)", "choices": ("tcp", "shared-tier")})
    kv_transfer_host: str = field(default="127.0.0.1", metadata={"help": "address a decode replica receives KV on"})
    kv_transfer_port: int = field(default=0, metadata={"help": "port a decode replica receives KV on (0: a free one)"})
    kv_transfer_timeout_s: float = field(default=10.0, metadata={"help": "a decode replica waits this long for a "
                                         "prompt's KV, then computes what did not arrive"})

    def __post_init__(self) -> None:
        _check(self.block_size >= 1, "--block-size must be at least 1", "block_size")
        _check(self.role == "both" or self.enable_prefix_caching, "--role prefill|decode hands KV over through the "
               "prefix cache: drop --no-enable-prefix-caching", "role")
        _check(self.kv_connector == "tcp" or self.kv_offload_url or self.kv_offload_dir_shared, "--kv-connector "
               "shared-tier needs --kv-offload-url or --kv-offload-dir with --kv-offload-dir-shared", "kv_connector")
        _check(self.kv_transfer_timeout_s > 0 and 0 <= self.kv_transfer_port < 65536,
               "--kv-transfer-timeout-s must be positive and --kv-transfer-port a port", "kv_transfer_port")
        _check(self.kv_cache_memory_gb is None or self.kv_cache_memory_gb > 0, "--kv-cache-memory-gb must be positive",
               "kv_cache_memory_gb")
        _check(self.kv_offload_memory_gb >= 0 and self.kv_offload_disk_gb > 0,
               "--kv-offload-memory-gb must be >= 0 and --kv-offload-disk-gb > 0", "kv_offload_memory_gb")
        _check(self.kv_offload_dir or not self.kv_offload_dir_shared, "--kv-offload-dir-shared needs --kv-offload-dir",
               "kv_offload_dir_shared")
        _check(self.kv_offload_url is None or self.kv_offload_url.startswith(("redis://", "rediss://", "unix://")),
               "--kv-offload-url must be redis://HOST:PORT/DB (or rediss://, unix://)", "kv_offload_url")
        _check(not (self.kv_offload_memory_gb or self.kv_offload_dir or self.kv_offload_url) or self.enable_prefix_caching,
               "the KV offload tiers keep prefix-cache blocks: they need prefix caching "
               "(drop --no-enable-prefix-caching)", "kv_offload_memory_gb")


@dataclass
class SchedulerConfig:
    """Continuous batching: the step's token budget, chunked prefill, the waiting queue's order."""

    max_num_seqs: int = field(default=128, metadata={"help": "most sequences in one step"})
    max_num_batched_tokens: int = field(default=2048, metadata={"help": "token budget of one step (chunked prefill fills it)"})
    prefill_step_factor: float = field(default=1.5, metadata={"help": "while sequences decode, a step carrying the prefill "
                                       "of a long prompt may cost at most this many decode-only steps (learned from measured "
                                       "step times), so streams stay smooth under long-prompt bursts; 0: off"})
    metered_prefill_min_tokens: int = field(default=1024, metadata={"help": "prompts with at most this many tokens left to "
                                            "prefill go in whole, outside the --prefill-step-factor budget"})
    schedule_policy: str = field(default="lpm", metadata={"help": "order of waiting requests: fcfs; lpm (longest cached "
                                 "prefix first); dfs-weight (SGLang's, keeps one branch of the tree hot)",
                                 "choices": SCHEDULE_POLICIES})
    starvation_timeout_s: float = field(default=10.0, metadata={"help": "a request waiting longer than this goes first, "
                                        "whatever the cache-aware order"})
    # internal knobs (no flag): tests, the batching baselines and the simulator's profiles set them
    long_prefill_token_threshold: int = field(default=0, metadata={"cli": False})  # cap on one prefill chunk; 0: none
    min_prefill_chunk: int = field(default=16, metadata={"cli": False})  # a step's first prefill chunk gets this much
    max_reorder_queue: int = field(default=256, metadata={"cli": False})  # longer waiting queues stay fcfs (cost)
    chunked_prefill: bool = field(default=True, metadata={"cli": False})  # False: a prompt's prefill runs whole
    static_batching: bool = field(default=False, metadata={"cli": False})  # batch-then-wait baseline
    # False: a step with prefill work carries only prefill chunks, decodes wait (SGLang without
    # --enable-mixed-chunk); True: decodes and prefill chunks share every step (vLLM V1)
    mixed_prefill: bool = field(default=True, metadata={"cli": False})
    # a request may share the blocks another chunk of the same step fills with its prompt's tokens and run
    # in that step (False: it waits a step for them to reach the cache, as SGLang's in-batch check does)
    share_prefix_in_step: bool = field(default=True, metadata={"cli": False})

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            _check(getattr(self, name) >= 1, f"{_flag(name)} must be at least 1", name)
        _check(self.prefill_step_factor == 0 or self.prefill_step_factor >= 1,
               "--prefill-step-factor must be 0 (off) or at least 1", "prefill_step_factor")
        _check(self.schedule_policy in SCHEDULE_POLICIES,
               f"--schedule-policy must be one of {', '.join(SCHEDULE_POLICIES)}", "schedule_policy")
        _check(self.starvation_timeout_s > 0, "--starvation-timeout-s must be positive", "starvation_timeout_s")


@dataclass
class SpeculationConfig:
    """Speculative decoding: who drafts, how many tokens, whether the count adapts."""

    speculative_method: str | None = field(default=None, metadata={"help": "speculative decoding: ngram (prompt "
                                           "lookup, no second model) or draft (--speculative-model); default off",
                                           "choices": SPECULATIVE_METHODS})
    num_speculative_tokens: int = field(default=5, metadata={"help": "most tokens drafted per request and step"})
    adaptive_speculation: bool = field(default=True, metadata={"help": "draft only as many tokens per request as "
                                       "the measured acceptance and the step-time model say pay (down to none at "
                                       "large batches); --no-adaptive-speculation always drafts the maximum"})
    ngram_min: int = field(default=2, metadata={"help": "shortest tail that prompt lookup matches"})
    ngram_max: int = field(default=4, metadata={"help": "longest tail that prompt lookup matches (tried first)"})
    speculative_model: str | None = field(default=None, metadata={"help": "draft model for --speculative-method "
                                          "draft: a Hugging Face folder or .gguf with the target's tokenizer"})

    def __post_init__(self) -> None:
        m = self.speculative_method
        _check(m is None or m in SPECULATIVE_METHODS, "--speculative-method must be ngram or draft", "speculative_method")
        _check(m != "draft" or bool(self.speculative_model), "--speculative-method draft needs --speculative-model PATH",
               "speculative_model")
        _check(not self.speculative_model or m == "draft",
               "--speculative-model is used only with --speculative-method draft", "speculative_model")
        _check(1 <= self.num_speculative_tokens <= 16, "--num-speculative-tokens must be in [1, 16]",
               "num_speculative_tokens")
        _check(1 <= self.ngram_min <= self.ngram_max <= 32, "need 1 <= --ngram-min <= --ngram-max <= 32", "ngram_min")

    @property
    def enabled(self) -> bool:
        return self.speculative_method is not None


@dataclass
class LoRAConfig:
    """LoRA adapters served beside the base model (docs/lora.md): which, how many at once, how large."""

    enable_lora: bool = field(default=False, metadata={"store_true": True, "help": "serve LoRA adapters (PEFT format); a request picks one by its `model` name"})  # noqa: E501
    lora_modules: list[str] = field(default_factory=list, metadata={"nargs": "+", "help": "adapters loaded at start, as name=path (a PEFT folder: adapter_config.json + adapter_model.safetensors)"})  # noqa: E501
    max_loras: int = field(default=4, metadata={"help": "most distinct adapters in one step (its requests wait for a slot beyond that)"})  # noqa: E501
    max_lora_rank: int = field(default=64, metadata={"help": "largest adapter rank accepted"})
    max_cpu_loras: int | None = field(default=None, metadata={"help": "adapters whose weights are kept in memory, least recently used dropped first (and read again on use); default: --max-loras x 4"})  # noqa: E501
    lora_dir: str | None = field(default=None, metadata={"help": "the folder POST /v1/load_lora_adapter may read adapters from (no runtime loading without it)"})  # noqa: E501

    def __post_init__(self) -> None:
        _check(self.max_loras >= 1, "--max-loras must be at least 1", "max_loras")
        _check(1 <= self.max_lora_rank <= 1024, "--max-lora-rank must be in [1, 1024]", "max_lora_rank")
        _check(self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
               "--max-cpu-loras must be at least --max-loras", "max_cpu_loras")
        _check(self.enable_lora or not (self.lora_modules or self.lora_dir),
               "--lora-modules and --lora-dir need --enable-lora", "enable_lora")
        if self.lora_modules:
            from kvserve.lora.registry import parse_lora_modules

            parse_lora_modules(self.lora_modules)

    @property
    def cpu_loras(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else 4 * self.max_loras


@dataclass
class StructuredOutputConfig:
    """Grammar-constrained decoding: the compile cache and its time limit."""

    grammar_cache_size: int = field(default=128, metadata={"help": "compiled grammars (JSON schemas, regexes, ...) "
                                    "kept for reuse, least recently used evicted first"})
    grammar_compile_timeout_s: float = field(default=10.0, metadata={"help": "a grammar that takes longer to compile "
                                             "is refused (400); compiles run in a child process, killed past this; "
                                             "0: compile in the engine process, unbounded"})

    def __post_init__(self) -> None:
        _check(self.grammar_cache_size >= 1, "--grammar-cache-size must be at least 1", "grammar_cache_size")
        _check(self.grammar_compile_timeout_s >= 0, "--grammar-compile-timeout-s must be >= 0",
               "grammar_compile_timeout_s")


@dataclass
class ServerConfig:
    """The HTTP server: where it listens, who may call it, what it refuses, what it logs."""

    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=8000, metadata={"help": "port to listen on"})
    served_model_names: list[str] = field(default_factory=list, metadata={
        "help": "name(s) clients use as `model` (default: the model's folder or file name)", "nargs": "+",
        "flag": "--served-model-name"})
    # when set, /v1 routes need "Authorization: Bearer <key>"
    api_key: str | None = field(default=None, metadata={
        "help": "require `Authorization: Bearer KEY` on /v1 routes (default: $KVSERVE_API_KEY)",
        "env": "KVSERVE_API_KEY"})
    max_waiting_requests: int | None = field(default=None, metadata={
        "help": "answer 429 when this many requests already wait (default: no limit)"})
    max_request_bytes: int = field(default=DEFAULT_MAX_REQUEST_BYTES, metadata={
        "help": "largest request body, 413 above (default: 8 MiB)"})
    # Logs hold no prompt or answer text unless this is set (a debugging aid): then each request's
    # prompt (its first ``max_log_len`` characters) and sampling parameters are logged at INFO.
    log_requests: bool = field(default=False, metadata={
        "help": "log each request's prompt and sampling parameters (debugging; without it, logs never hold "
                "prompt or answer text)", "store_true": True})
    max_log_len: int = field(default=200, metadata={"help": "with --log-requests, prompt characters logged"})
    graceful_shutdown_timeout: float = field(default=30.0, metadata={
        "help": "on SIGTERM, seconds to let requests in flight finish"})
    uvicorn_log_level: str = field(default="info", metadata={
        "help": "log level of the server", "choices": ("critical", "error", "warning", "info", "debug", "trace")})
    tool_call_parser: str = field(default="auto", metadata={
        "help": "how the model writes tool calls (docs/tool-calling.md): auto (detected from the chat template, "
                "hermes when it shows none), hermes, llama3_json, mistral; none: no function calling",
        "choices": TOOL_CALL_PARSERS})
    reasoning_parser: str | None = field(default=None, metadata={
        "help": "split a thinking model's reasoning from its answer (docs/tool-calling.md): deepseek_r1 (the "
                "output starts thinking, up to </think>) or qwen3 (a <think>...</think> block the output opens "
                "with); chat answers then carry message.reasoning_content and streams delta.reasoning_content; "
                "default: off"})
    otlp_traces_endpoint: str | None = field(default=None, metadata={
        "help": "send a trace span per request to this OpenTelemetry collector (OTLP over HTTP, e.g. "
                "http://127.0.0.1:4318/v1/traces; needs pip install kvserve[tracing]); docs/tracing.md"})
    ui: bool = field(default=True, metadata={
        "help": "serve the web page (chat and a live view of the engine) at / (docs/ui.md); --no-ui: off"})
    weights_dir: str | None = field(default=None, metadata={
        "help": "POST /update_weights_from_disk may load checkpoints from this directory only (model_path inside "
                "it, or relative to it); default: the route refuses every path"})
    replica_id: str | None = field(default=None, metadata={
        "help": "this server's name in GET /kv/events, for a router (default: host name, port and a random suffix)"})

    def __post_init__(self) -> None:
        _check(self.tool_call_parser in TOOL_CALL_PARSERS,
               f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)}", "tool_call_parser")
        # checked here, not by argparse choices: a one-line error, and the registry may gain parsers
        if self.reasoning_parser is not None:
            from kvserve.text.reasoning import check_reasoning_parser

            check_reasoning_parser(self.reasoning_parser)
        _check(self.max_waiting_requests is None or self.max_waiting_requests >= 0,
               "--max-waiting-requests must be at least 0", "max_waiting_requests")
        _check(self.max_request_bytes >= 1, "--max-request-bytes must be positive", "max_request_bytes")
        _check(self.max_log_len >= 0, "--max-log-len must be at least 0", "max_log_len")
        if self.otlp_traces_endpoint:  # checked at start-up, not after loading the model
            _check(self.otlp_traces_endpoint.startswith(("http://", "https://")),
                   "--otlp-traces-endpoint must be an http(s):// URL (OTLP over HTTP)", "otlp_traces_endpoint")
            _check(all(_installed(m) for m in ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http")),
                   "--otlp-traces-endpoint needs OpenTelemetry: pip install kvserve[tracing]", "otlp_traces_endpoint")


# the parts, by attribute name on KVServeConfig; ENGINE_PARTS are those the engine itself uses
PARTS: dict[str, type] = {"model": ModelOptions, "cache": CacheConfig, "scheduler": SchedulerConfig,
                          "speculation": SpeculationConfig, "structured": StructuredOutputConfig,
                          "lora": LoRAConfig, "server": ServerConfig}
ENGINE_PARTS = ("model", "cache", "scheduler", "speculation", "structured", "lora")


@dataclass
class KVServeConfig:
    model: ModelOptions = field(default_factory=ModelOptions)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)
    structured: StructuredOutputConfig = field(default_factory=StructuredOutputConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    server: ServerConfig = field(default_factory=ServerConfig)

    # -- flat names: the CLI and the Python API ----------------------------------------------
    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> KVServeConfig:
        """From flat keyword arguments (``model=..., max_num_seqs=8``): each names one field of one part."""
        where = _field_parts()
        unknown = set(kwargs) - set(where)
        if unknown:
            raise InvalidArgumentError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
        by_part: dict[str, dict[str, Any]] = {p: {} for p in PARTS}
        for name, value in kwargs.items():
            by_part[where[name]][name] = value
        return cls(**{p: PARTS[p](**values) for p, values in by_part.items()})

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, parts: tuple[str, ...] = ENGINE_PARTS) -> None:
        """A flag for every field of ``parts`` (in a group per part), with the field's default and help."""
        for part in parts:
            group = parser.add_argument_group(part, PARTS[part].__doc__)
            for f in fields(PARTS[part]):
                if f.metadata.get("cli", True):
                    _add_flag(group, f)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, parts: tuple[str, ...] = ENGINE_PARTS) -> KVServeConfig:
        """The config of parsed flags; parts without flags keep their defaults."""
        values = {}
        for part in parts:
            values[part] = PARTS[part](**{f.name: getattr(args, f.name) for f in fields(PARTS[part])
                                          if f.metadata.get("cli", True)})
        return cls(**values)

    def to_cli_args(self, parts: tuple[str, ...] = ENGINE_PARTS, skip: tuple[str, ...] = ()) -> list[str]:
        """The flags that give this config back through ``from_cli_args`` (the inverse of parsing them):
        a flag for each field that differs from its default, except the ``skip`` fields and those read
        from an environment variable (a secret such as --api-key: pass it through the environment)."""
        args: list[str] = []
        for part in parts:
            for f in fields(PARTS[part]):
                meta = f.metadata
                if not meta.get("cli", True) or meta.get("env") or f.name in skip:
                    continue
                value = getattr(getattr(self, part), f.name)
                default = f.default_factory() if callable(f.default_factory) else f.default
                if value == default or value is None:
                    continue
                flag = meta.get("flag", _flag(f.name))
                if meta.get("store_true"):
                    args.append(flag)
                elif f.type in (bool, "bool") or meta.get("tristate"):
                    args.append(flag if value else "--no-" + flag[2:])
                elif meta.get("nargs"):
                    args += [flag, *map(str, value)]
                else:
                    args += [flag, str(value)]
        return args

    def to_kwargs(self) -> dict[str, Any]:
        """The flat keyword arguments of the engine parts (the inverse of ``from_kwargs``)."""
        return {f.name: getattr(getattr(self, p), f.name) for p in ENGINE_PARTS for f in fields(PARTS[p])}


def _field_parts() -> dict[str, str]:
    """field name -> the part that holds it (names are unique across parts)."""
    return {f.name: p for p, cls in PARTS.items() for f in fields(cls)}


def _add_flag(group: Any, f: Any) -> None:
    meta = f.metadata
    flag = meta.get("flag", _flag(f.name))
    default = f.default_factory() if callable(f.default_factory) else f.default
    if meta.get("env"):
        default = os.environ.get(meta["env"], default)
    if meta.get("store_true"):
        group.add_argument(flag, dest=f.name, action="store_true", help=meta.get("help"))
    elif f.type in (bool, "bool") or meta.get("tristate"):  # tristate: absent is None (auto)
        group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                           help=meta.get("help"))
    elif meta.get("nargs"):
        group.add_argument(flag, dest=f.name, nargs=meta["nargs"], default=default, help=meta.get("help"))
    else:
        kind = {"int": int, "float": float, "str": str}[str(f.type).split(" ")[0].replace("|", "").strip()]
        group.add_argument(flag, dest=f.name, type=kind, default=default, help=meta.get("help"),
                           choices=meta.get("choices"))


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False
