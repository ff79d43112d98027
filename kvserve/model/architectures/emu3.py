"""Emu3's text model (``Emu3ForCausalLM``: Emu3's language model alone, a vocabulary holding the image tokens too):
Llama's layers, names and options (its attention dropout is training's only)."""

from kvserve.model.architectures import Architecture, register

register(Architecture("Emu3ForCausalLM"))
