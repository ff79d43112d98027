"""Model shapes for the simulator: parameter counts (total and active), KV bytes per token.

Built from a Hugging Face ``config.json`` through the engine's own parse (``ModelConfig``, with the
registered architectures' options; others by their common keys, experts under any of their usual
names), or a preset.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve.errors import InvalidArgumentError
from kvserve.kv.layout import EIGHT_BIT_KV_DTYPES, KVLayout

BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "fp4": 0.5625}  # weights; fp4: 4 bits + a scale per 16
# KV precision -> layout dtype: the engine's --kv-cache-dtype names for 8 bits (fp8 = fp8_e4m3, int8)
KV_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", **EIGHT_BIT_KV_DTYPES}


@dataclass
class ModelSpec:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool = False
    experts: int = 0  # 0: dense
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_expert_intermediate: int = 0
    max_context: int = 131072
    sliding_window: int | None = None  # every layer's window (``ModelConfig.kv_window``): blocks behind it are freed
    attn_params: int = 0  # a layer's attention weights where not q/k/v/o of these heads (latent attention); 0: those
    dense_layers: int = 0  # of an MoE model, the layers with the dense MLP (DeepSeek's first, Qwen2-MoE's mlp_only)
    cache_layers: int = 0  # the KV pool's layers where not one a layer (ModelConfig.kv_cache_layers: LFM2); 0: layers
    # (K/V heads, head dim) of each pool layer where they differ (ModelConfig.kv_layer_shapes: Gemma 4)
    cache_shapes: tuple[tuple[int, int], ...] | None = None

    @property
    def attn_params_per_layer(self) -> int:
        if self.attn_params:
            return self.attn_params
        q = self.heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        return self.hidden * q + 2 * self.hidden * kv + q * self.hidden

    def mlp_params_per_layer(self, active: bool) -> int:
        if not self.experts:
            return 3 * self.hidden * self.intermediate
        n = self.experts_per_token if active else self.experts
        return (n * 3 * self.hidden * self.expert_intermediate + 3 * self.hidden * self.shared_expert_intermediate
                + self.hidden * self.experts)

    def layer_params(self, active: bool) -> int:
        dense = 3 * self.hidden * self.intermediate * self.dense_layers if self.experts else 0
        return (self.layers * self.attn_params_per_layer + dense
                + (self.layers - (self.dense_layers if self.experts else 0)) * self.mlp_params_per_layer(active))

    @property
    def embed_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def total_params(self) -> int:
        return self.layer_params(False) + self.embed_params * (1 if self.tied else 2)

    @property
    def active_params(self) -> int:
        return self.layer_params(True) + self.embed_params * (1 if self.tied else 2)

    def kv_layout(self, kv_precision: str, block_size: int = 16) -> KVLayout:
        return KVLayout(self.cache_layers or self.layers, self.kv_heads, self.head_dim, block_size,
                        KV_DTYPES[kv_precision], self.cache_shapes)

    def kv_bytes_per_token(self, kv_precision: str) -> float:
        return float(self.kv_layout(kv_precision).bytes_per_token)

    def weight_bytes(self, precision: str) -> float:
        """Weights in memory: layers at ``precision``; embeddings and lm_head stay 16-bit
        (as vLLM and TRT-LLM keep them) unless everything is fp32."""
        emb = BYTES["fp32"] if precision == "fp32" else BYTES["bf16"]
        return self.layer_params(False) * BYTES[precision] + self.embed_params * (1 if self.tied else 2) * emb

    @classmethod
    def from_hf_config(cls, d: dict[str, Any], name: str = "model") -> "ModelSpec":
        """The shape of a config.json as the engine parses it (``ModelConfig.from_hf_dict``), or, for an
        architecture it does not serve, as its common keys tell."""
        from kvserve.model.config import ModelConfig

        try:
            cfg = ModelConfig.from_hf_dict(d, strict=False)
        except KeyError as e:
            raise InvalidArgumentError(f"config.json lacks {e.args[0]!r}") from e
        except (TypeError, ValueError) as e:
            raise InvalidArgumentError(f"config.json: {e}") from e
        return cls(name=name, hidden=cfg.hidden_size, layers=cfg.num_hidden_layers, heads=cfg.num_attention_heads,
                   kv_heads=cfg.num_key_value_heads, head_dim=int(cfg.head_dim or 0),
                   intermediate=cfg.intermediate_size, vocab=cfg.vocab_size, tied=cfg.tie_word_embeddings,
                   experts=cfg.num_experts, experts_per_token=cfg.num_experts_per_tok,
                   expert_intermediate=cfg.moe_intermediate_size,
                   shared_expert_intermediate=cfg.shared_expert_intermediate_size,
                   max_context=d.get("max_position_embeddings", 131072), sliding_window=cfg.kv_window(),
                   attn_params=cfg.attention_params() if cfg.kv_lora_rank else 0,
                   dense_layers=sum(not cfg.is_moe(i) for i in range(cfg.num_hidden_layers)) if cfg.num_experts else 0,
                   cache_layers=cfg.kv_cache_layers,
                   cache_shapes=None if (shapes := cfg.kv_layer_shapes()) is None else tuple(shapes))


def _llama(name, hidden, layers, heads, kv, inter, vocab, tied=False, ctx=131072):
    return ModelSpec(name, hidden, layers, heads, kv, hidden // heads, inter, vocab, tied, max_context=ctx)


PRESETS: dict[str, ModelSpec] = {
    "llama-3.1-8b": _llama("Llama-3.1-8B", 4096, 32, 32, 8, 14336, 128256),
    "llama-3.1-70b": _llama("Llama-3.1-70B", 8192, 80, 64, 8, 28672, 128256),
    "qwen2.5-7b": _llama("Qwen2.5-7B", 3584, 28, 28, 4, 18944, 152064, ctx=32768),
    "qwen2.5-72b": _llama("Qwen2.5-72B", 8192, 80, 64, 8, 29568, 152064, ctx=32768),
    "smollm2-135m": _llama("SmolLM2-135M", 576, 30, 9, 3, 1536, 49152, tied=True, ctx=8192),
    "mixtral-8x7b": ModelSpec("Mixtral-8x7B", 4096, 32, 32, 8, 128, 14336, 32000, experts=8, experts_per_token=2,
                              expert_intermediate=14336, max_context=32768),
}


def get_model(spec: str) -> ModelSpec:
    """A preset name, or a path to a config.json (or a folder holding one)."""
    if spec.lower() in PRESETS:
        return PRESETS[spec.lower()]
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise InvalidArgumentError(f"unknown model {spec!r}: a preset ({', '.join(PRESETS)}) or a config.json path")
    try:
        return ModelSpec.from_hf_config(json.loads(path.read_text()), name=path.parent.name or "model")
    except json.JSONDecodeError as e:
        raise InvalidArgumentError(f"{path} is not valid JSON: {e}") from e
