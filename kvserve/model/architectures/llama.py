"""Llama 1/2/3.x (and SmolLM, Llama-3.2's tied embeddings, llama3 rope scaling): the shared decoder's defaults."""

from kvserve.model.architectures import Architecture, register

register(Architecture("LlamaForCausalLM", gguf="llama"))
