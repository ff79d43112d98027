"""Gemma 3's multimodal checkpoints (4B and up), text only: the text model is Gemma 3's (``text_config``), its
weights under "language_model." (or transformers 5's "model.language_model."); the vision tower and the
projector are not read (the loader logs so)."""

from kvserve.model.architectures import Architecture, register
from kvserve.model.architectures.gemma2 import GEMMA_WEIGHTS
from kvserve.model.architectures.gemma3 import gemma3_config

# a multimodal checkpoint's text weights -> ours (transformers 4's names, then 5's); others are not read
MULTIMODAL_PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model.",
                       "language_model.lm_head.": "lm_head.", "lm_head.": "lm_head."}


def text_part(d: dict) -> dict:
    """The text part, with the top-level keys transformers keeps there (tied embeddings, token ids); a config without
    a ``text_config`` is flat (Qwen2-VL's as released, a GGUF file's metadata) and is its own text part."""
    if "text_config" not in d:
        return d
    text = dict(d["text_config"] or {})
    for key in ("tie_word_embeddings", "bos_token_id", "eos_token_id"):
        if key in d and key not in text:
            text[key] = d[key]
    return text


register(Architecture("Gemma3ForConditionalGeneration", gemma3_config, weights=GEMMA_WEIGHTS, text_config=text_part,
                      prefixes=MULTIMODAL_PREFIXES))
