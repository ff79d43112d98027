"""Mistral 3's multimodal checkpoints (Mistral Small 3.1 and 3.2, Devstral), text only: the text model is Mistral's
(``text_config``), its weights under "language_model." (or transformers 5's "model.language_model."); the Pixtral
vision tower and the projector are not read. Ministral 3's text models scale queries by position beyond the
original context (``llama_4_scaling_beta``): refused."""

from kvserve.model.architectures import Architecture, register
from kvserve.model.architectures.gemma3_mm import MULTIMODAL_PREFIXES, text_part
from kvserve.model.architectures.mistral import mistral_config


def mistral3_config(d: dict) -> dict:
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if params.get("llama_4_scaling_beta"):
        raise ValueError(f"{d.get('model_type', 'this')} text model's llama_4_scaling_beta (queries scaled by position) "
                         "is not supported")
    return mistral_config(d)


register(Architecture("Mistral3ForConditionalGeneration", mistral3_config, text_config=text_part,
                      prefixes=MULTIMODAL_PREFIXES))
