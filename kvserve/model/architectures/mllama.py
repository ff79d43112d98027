"""Mllama (Llama 3.2 Vision), text only: Llama's layers with llama3 rotary scaling, among them cross-attention layers
(``cross_attention_layers``) that read the image's states. Without an image transformers skips those layers outright,
so for a text prompt the decoder is the other layers alone (``checkpoint_layers``: their indices in the checkpoint).
The embedding table has 8 rows past the vocabulary (the image token's and reserved ones, which the LM head never
produces): cut to the vocabulary at load. Image inputs are not supported (a text-only engine): the vision tower, the
projector and the cross-attention layers are not read. The multimodal checkpoints keep the text model under
"language_model." (``MULTIMODAL_PREFIXES``)."""

from typing import Any

from kvserve.model.architectures import Architecture, register
from kvserve.model.architectures.gemma3_mm import MULTIMODAL_PREFIXES, text_part


def mllama_config(d: dict) -> dict:
    """The layers a text prompt runs: every one but the cross-attention layers, by their checkpoint indices."""
    cross = set(d.get("cross_attention_layers") or ())
    kept = [i for i in range(d["num_hidden_layers"]) if i not in cross]
    # (transformers never ties Mllama's head to the embeddings, whatever tie_word_embeddings says)
    return {"num_hidden_layers": len(kept), "checkpoint_layers": kept, "tie_word_embeddings": False}


def cut_embeddings(cfg: Any, weights: dict[str, Any]) -> dict[str, Any]:
    """The embedding table's rows of the vocabulary (the LM head's), without the image token's and reserved ones."""
    embed = weights.get("model.embed_tokens.weight")
    if embed is not None and embed.shape[0] > cfg.vocab_size:
        weights["model.embed_tokens.weight"] = embed[: cfg.vocab_size].contiguous()
    return weights


register(Architecture("MllamaForCausalLM", mllama_config, adjust_weights=cut_embeddings))
register(Architecture("MllamaForConditionalGeneration", mllama_config, adjust_weights=cut_embeddings,
                      text_config=text_part, prefixes=MULTIMODAL_PREFIXES))
