"""DiffLlama: Llama's layers with differential attention (``kvserve.model.diff_attention``: two softmaxes' difference
over value heads paired across the halves, lambda from the layer's ``lambda_q1/k1/q2/k2`` vectors, the result
RMS-normed without a weight), K/V heads an even number."""

from kvserve.model.architectures import Architecture, register


def diffllama_config(d: dict) -> dict:
    return {"diff_attention": True}


register(Architecture("DiffLlamaForCausalLM", diffllama_config))
