"""Mistral 3's multimodal checkpoints (Mistral Small 3.1 and 3.2, Devstral), text only: the text model is Mistral's
(``text_config``), its weights under "language_model." (or transformers 5's "model.language_model."); the Pixtral
vision tower and the projector are not read. Ministral 3 (its text model alone: Ministral3ForCausalLM) scales queries
by position beyond the original context (``llama_4_scaling_beta``); llama.cpp's "mistral3" files are Ministral 3's."""

from kvserve.model.architectures import Architecture, GGUFGet, register
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
def ministral3_gguf(get: GGUFGet) -> dict:
    """llama.cpp's "mistral3" files (Ministral 3; Mistral's Llama lineage, q/k rows permuted): the query scale's beta as
    the attention temperature scale, over the temperature length or else yarn's original context; yarn's
    mscale_all_dim as its log multiplier (written as it is, not x 0.1 as for DeepSeek)."""
    extra: dict = {}
    if get("attention.temperature_scale"):
        length = get("attention.temperature_length") or get("rope.scaling.original_context_length")
        extra.update(llama_4_scaling_beta=float(get("attention.temperature_scale")),
                     original_max_position_embeddings=int(length or get("context_length")))
    if get("rope.scaling.yarn_log_multiplier"):
        mscale = float(get("rope.scaling.yarn_log_multiplier"))
        extra.update(mscale=mscale, mscale_all_dim=mscale)
    return {"rope_scaling": extra} if extra else {}


register(Architecture("Ministral3ForCausalLM", mistral3_config, gguf="mistral3", gguf_permuted=True,
                      gguf_config=ministral3_gguf))
