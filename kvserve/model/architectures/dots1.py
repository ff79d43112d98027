"""dots.llm1 (rednote's 142B-A14B): Qwen3's attention (per-head q/k norms; a window on the layers ``layer_types``
marks sliding) over DeepSeek-V3's layer plan and router (sigmoid scores chosen with a bias from the best expert
groups, ranked by their best two; shared experts without a gate). llama.cpp's "dots1" files: the router's keys as
GLM-4.5's (sigmoid scores: the only ones its converter writes), no window."""

from kvserve.model.architectures import Architecture, GGUFGet, register
from kvserve.model.architectures.deepseek_v2 import DEEPSEEK_WEIGHTS, dense_first_layers
from kvserve.model.architectures.deepseek_v3 import v3_experts
from kvserve.model.config import SLIDING


def dots1_config(d: dict) -> dict:
    kinds = d.get("layer_types")
    window = d.get("sliding_window") if kinds and SLIDING in kinds else None
    return {**v3_experts(d, dense_first_layers(d), norm_topk_default=False), "qk_norm": "head",
            "attention_bias": bool(d.get("attention_bias", False)), "o_proj_bias": bool(d.get("attention_bias", False)),
            "sliding_window": window, "layer_types": list(kinds) if window else None}


def dots1_gguf(get: GGUFGet) -> dict:
    return {"n_shared_experts": int(get("expert_shared_count", 0)),
            "first_k_dense_replace": int(get("leading_dense_block_count", 0)),
            "routed_scaling_factor": float(get("expert_weights_scale", 1.0)),
            "norm_topk_prob": bool(get("expert_weights_norm", False)),
            "n_group": int(get("expert_group_count", 1)), "topk_group": int(get("expert_group_used_count", 1))}


register(Architecture("Dots1ForCausalLM", dots1_config, weights=DEEPSEEK_WEIGHTS, gguf="dots1", gguf_config=dots1_gguf))
