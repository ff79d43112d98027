"""GLM-5 (GlmMoeDsaForCausalLM): DeepSeek-V3.2's layers (latent attention with a lightning indexer, DeepSeek-V3's
router) with the indexer's rotary on interleaved pairs, and the choice of keys shared across layers: the layers
``indexer_types`` marks "shared" reuse the last "full" layer's (``ModelConfig.index_layers``); without the key, every
``index_topk_freq``-th layer from ``index_skip_topk_offset`` runs its own (``index_topk_pattern``: "F"/"S" per layer)."""

from kvserve.model.architectures import Architecture, register
from kvserve.model.architectures.deepseek_v2 import DEEPSEEK_WEIGHTS
from kvserve.model.architectures.deepseek_v32 import indexed_latent_config


def indexer_types(d: dict) -> list[str]:
    kinds = d.get("indexer_types")
    if kinds is not None:
        return list(kinds)
    pattern = d.get("index_topk_pattern")
    if pattern is not None:
        return [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
    every, offset = max(d.get("index_topk_freq", 1), 1), d.get("index_skip_topk_offset", 2)
    return ["full" if max(i - offset + 1, 0) % every == 0 else "shared" for i in range(d["num_hidden_layers"])]


def glm_moe_dsa_config(d: dict) -> dict:
    # (mlp_bias: a config key transformers' model never reads, its MLPs unbiased)
    return {**indexed_latent_config(d, True, 32), "index_layers": [kind == "full" for kind in indexer_types(d)],
            "mlp_bias": False}


register(Architecture("GlmMoeDsaForCausalLM", glm_moe_dsa_config, weights=DEEPSEEK_WEIGHTS))
