"""dots.llm1 (rednote's 142B-A14B): Qwen3's attention (per-head q/k norms; a window on the layers ``layer_types``
marks sliding) over DeepSeek-V3's layer plan and router (sigmoid scores chosen with a bias from the best expert
groups, ranked by their best two; shared experts without a gate)."""

from kvserve.model.architectures import Architecture, register
from kvserve.model.architectures.deepseek_v2 import DEEPSEEK_WEIGHTS, dense_first_layers
from kvserve.model.architectures.deepseek_v3 import v3_experts
from kvserve.model.config import SLIDING


def dots1_config(d: dict) -> dict:
    kinds = d.get("layer_types")
    window = d.get("sliding_window") if kinds and SLIDING in kinds else None
    return {**v3_experts(d, dense_first_layers(d), norm_topk_default=False), "qk_norm": "head",
            "attention_bias": bool(d.get("attention_bias", False)), "o_proj_bias": bool(d.get("attention_bias", False)),
            "sliding_window": window, "layer_types": list(kinds) if window else None}


register(Architecture("Dots1ForCausalLM", dots1_config, weights=DEEPSEEK_WEIGHTS))
