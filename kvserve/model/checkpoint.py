"""What a loaded checkpoint is: ``LoadedModel`` and the weights the engine expects of it.

Both loaders (``hf_loader``, ``gguf_loader``) produce a ``LoadedModel`` whose weights are torch
tensors named as in Hugging Face's Llama implementation; ``check_weights`` holds them to the
names and shapes the config implies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvserve.errors import ModelLoadError
from kvserve.model.config import ModelConfig


@dataclass
class LoadedModel:
    """Everything the engine needs from a checkpoint."""

    config: ModelConfig
    # Hugging Face Llama names; "lm_head.weight" only when the embeddings are untied
    weights: dict[str, torch.Tensor]
    tokenizer: Any  # transformers PreTrainedTokenizerFast (TokenizersBackend in transformers 5)
    name: str  # reported by /v1/models: folder name or .gguf file stem


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter the engine reads, with its Hugging Face shape."""
    h, d = config.hidden_size, int(config.head_dim or 0)
    q_rows, kv_rows = config.num_attention_heads * d, config.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q_rows, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv_rows, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv_rows, h)
        if config.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q_rows,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_rows,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_rows,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_rows)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (config.intermediate_size, h)
        shapes[p + "mlp.up_proj.weight"] = (config.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, config.intermediate_size)
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def check_weights(config: ModelConfig, weights: dict[str, torch.Tensor], source: str) -> None:
    """Raise ``ModelLoadError`` unless ``weights`` holds every expected tensor in its expected shape."""
    expected = expected_weight_shapes(config)
    missing = [name for name in expected if name not in weights]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ModelLoadError(f"{source}: missing weights {', '.join(missing[:5])}{more}")
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise ModelLoadError(
                f"{source}: {name} has shape {tuple(weights[name].shape)}, the config implies {shape}"
            )
