"""Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE checkpoints, text only: their text models are Qwen2's, Qwen3's and
Qwen3-MoE's (``text_config``). Multimodal rotary (``mrope_section``) rotates a text token by the same position in each
of its sections, which is plain rotary; the vision tower (``visual.``, ``model.visual.``) is not read. Qwen3-VL-MoE
stores its experts stacked, each [hidden, 2 x inter] (gate's columns, then up's), and always renormalises them."""

from kvserve.model.architectures import Architecture, StackedExperts, register
from kvserve.model.architectures.gemma3_mm import text_part
from kvserve.model.architectures.qwen2 import qwen2_config
from kvserve.model.architectures.qwen3 import qwen3_config
from kvserve.model.architectures.qwen_moe import qwen3_moe_config

# transformers 5's names (the language model under "model.language_model."), then 4's (under "model.")
VL_PREFIXES = {"model.language_model.": "model.", "model.": "model.", "lm_head.": "lm_head."}


def text_rotary(config):
    """``config`` over the text part, its rotary plain where the checkpoint says multimodal ("mrope")."""
    def parse(d: dict) -> dict:
        scaling = d.get("rope_scaling") or d.get("rope_parameters") or {}
        out = config(d)
        if "mrope" in (scaling.get("type"), scaling.get("rope_type")):  # no scaling of its own beside the sections
            out["rope_scaling"] = None
        return out
    return parse


# llama.cpp's "qwen2vl", "qwen3vl" and "qwen3vlmoe" files hold the text model alone, flat (its rotary sections beside:
# plain rotary for text); Qwen2.5-VL's are "qwen2vl" too
register(Architecture("Qwen2VLForConditionalGeneration", text_rotary(qwen2_config), text_config=text_part,
                      prefixes=VL_PREFIXES, gguf="qwen2vl"))
register(Architecture("Qwen2_5_VLForConditionalGeneration", text_rotary(qwen2_config), text_config=text_part,
                      prefixes=VL_PREFIXES))
register(Architecture("Qwen3VLForConditionalGeneration", text_rotary(qwen3_config), text_config=text_part,
                      prefixes=VL_PREFIXES, gguf="qwen3vl"))
register(Architecture("Qwen3VLMoeForConditionalGeneration",
                      text_rotary(lambda d: {**qwen3_moe_config(d), "norm_topk_prob": True}), text_config=text_part,
                      prefixes=VL_PREFIXES, stacked_experts=StackedExperts(interleaved=False), gguf="qwen3vlmoe"))
