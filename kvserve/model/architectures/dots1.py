"""dots.llm1 (rednote's 142B-A14B): Qwen3's attention (per-head q/k norms; a window on the layers ``layer_types``
marks sliding) over DeepSeek-V3's layer plan and router (sigmoid scores chosen with a bias from the best expert
groups, ranked by their best two; shared experts without a gate)."""

from kvserve.model.architectures import Architecture, register
from kvserve.model.architectures.deepseek_v2 import DEEPSEEK_WEIGHTS, deepseek_experts, dense_first_layers
from kvserve.model.config import SLIDING


def dots1_config(d: dict) -> dict:
    kinds = d.get("layer_types")
    window = d.get("sliding_window") if kinds and SLIDING in kinds else None
    experts = deepseek_experts(d, dense_first_layers(d), d.get("n_group") or 1, d.get("topk_group") or 1)
    return {**experts, "qk_norm": "head", "attention_bias": bool(d.get("attention_bias", False)),
            "o_proj_bias": bool(d.get("attention_bias", False)), "router_scoring": "sigmoid", "selection_bias": True,
            "group_scoring": "top2", "sliding_window": window, "layer_types": list(kinds) if window else None}


register(Architecture("Dots1ForCausalLM", dots1_config, weights=DEEPSEEK_WEIGHTS))
