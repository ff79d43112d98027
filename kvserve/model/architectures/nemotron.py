"""Nemotron (Nemotron-3, Minitron 4B/8B, Nemotron-Mini): LayerNorms that scale by 1 + weight (LayerNorm1P) with
biases, a non-gated MLP of ``hidden_act`` (relu squared), rotary over the first ``partial_rotary_factor`` of each
head. llama.cpp's "nemotron" files (their norms stored with the 1 added)."""

from kvserve.model.architectures import Architecture, GGUFGet, gguf_rotary_share, partial_rotary, register


def nemotron_config(d: dict) -> dict:
    return {"norm_type": "layer", "norm_offset": 1.0, "gated_mlp": False, "hidden_act": d.get("hidden_act") or "relu2",
            "rms_norm_eps": float(d.get("norm_eps", d.get("layer_norm_eps", 1e-5))),
            "partial_rotary_factor": partial_rotary(d, 0.5)}


def nemotron_gguf(get: GGUFGet) -> dict:
    return {**gguf_rotary_share(get), "norm_eps": float(get("attention.layer_norm_epsilon", 1e-5))}


register(Architecture("NemotronForCausalLM", nemotron_config, weights={"gate_proj": None}, gguf="nemotron",
                      gguf_config=nemotron_gguf))
