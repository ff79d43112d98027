"""Llama 1/2/3.x (and SmolLM, Llama-3.2's tied embeddings, llama3 rope scaling): the shared decoder's defaults."""

from kvserve.model.architectures import Architecture, GGUFGet, register


def llama_gguf(get: GGUFGet) -> dict:
    """llama.cpp writes Mistral and Mixtral as "llama" too: experts make it Mixtral, a window Mistral."""
    if get("expert_count"):
        return {"architectures": ["MixtralForCausalLM"]}
    if get("attention.sliding_window"):
        return {"architectures": ["MistralForCausalLM"]}
    return {}


register(Architecture("LlamaForCausalLM", gguf="llama", gguf_config=llama_gguf))
