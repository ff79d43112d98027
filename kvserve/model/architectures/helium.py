"""Helium (Kyutai): Llama with rotary on interleaved pairs, ``attention_bias`` on q, k and v only."""

from kvserve.model.architectures import Architecture, register

register(Architecture("HeliumForCausalLM", lambda d: {"o_proj_bias": False, "rope_interleaved": True}))
