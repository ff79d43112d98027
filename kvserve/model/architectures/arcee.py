"""Arcee (AFM-4.5B): Llama with a non-gated MLP, ``down(relu(up(x)) ** 2)``. llama.cpp's "arcee" files (its
Llama lineage: q/k rows permuted)."""

from kvserve.model.architectures import Architecture, register

register(Architecture("ArceeForCausalLM", lambda d: {"gated_mlp": False, "hidden_act": d.get("hidden_act") or "relu2"},
                      weights={"gate_proj": None}, gguf="arcee", gguf_permuted=True))
