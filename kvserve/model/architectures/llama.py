"""Llama 1/2/3.x (and SmolLM, Llama-3.2's tied embeddings, llama3 rope scaling): the shared decoder's defaults."""

from kvserve.model.architectures import Architecture, GGUFGet, register


def llama_gguf(get: GGUFGet) -> dict:
    """llama.cpp writes Mistral and Mixtral as "llama" too, without their sliding window: Mistral is Llama
    there, and experts make it Mixtral."""
    return {"architectures": ["MixtralForCausalLM"]} if get("expert_count") else {}


register(Architecture("LlamaForCausalLM", gguf="llama", gguf_permuted=True, gguf_config=llama_gguf))
