"""Apertus 1.5's text model (Swiss AI): Apertus's layers (per-head q/k norms, a non-gated xIELU MLP) over a vocabulary
extended by image and audio codes, its LM head pruned to the text ids where ``output_vocab_size`` is set (the others
are input-only: never drawn)."""

from kvserve.model.architectures import Architecture, register
from kvserve.model.architectures.apertus import APERTUS_WEIGHTS, apertus_config


def apertus1p5_config(d: dict) -> dict:
    head = d.get("output_vocab_size") or 0
    if head and (d.get("tie_word_embeddings") or not 0 < head <= d["vocab_size"]):
        raise ValueError("Apertus1p5TextForCausalLM: a pruned LM head (output_vocab_size) is its own weight of "
                         "1..vocab_size rows")
    return {**apertus_config(d), "output_vocab_size": 0 if head == d["vocab_size"] else head}


register(Architecture("Apertus1p5TextForCausalLM", apertus1p5_config, weights=APERTUS_WEIGHTS))
