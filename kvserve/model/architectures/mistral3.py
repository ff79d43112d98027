"""Mistral 3's multimodal checkpoints (Mistral Small 3.1 and 3.2, Devstral), text only: the text model is Mistral's
(``text_config``), its weights under "language_model." (or transformers 5's "model.language_model."); the Pixtral
vision tower and the projector are not read. Ministral 3 (its text model alone: Ministral3ForCausalLM) scales queries
by position beyond the original context (``llama_4_scaling_beta``)."""

from kvserve.model.architectures import Architecture, register
from kvserve.model.architectures.gemma3_mm import MULTIMODAL_PREFIXES, text_part
from kvserve.model.architectures.mistral import mistral_config


def mistral3_config(d: dict) -> dict:
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    out = mistral_config(d)
    if params.get("llama_4_scaling_beta"):
        length = params.get("original_max_position_embeddings") or d.get("max_position_embeddings")
        out["query_position_scale"] = (float(params["llama_4_scaling_beta"]), int(length))
    return out


register(Architecture("Mistral3ForConditionalGeneration", mistral3_config, text_config=text_part,
                      prefixes=MULTIMODAL_PREFIXES))
register(Architecture("Ministral3ForCausalLM", mistral3_config))
