"""LFM3 (Liquid's LFM3): LFM2's short convolutions (``conv_L_cache`` taps) among attention layers that are
"full_attention" or "sliding_attention" (a ``sliding_window``, rotating by their own base, unscaled:
``rope_local_theta``; the full ones by ``rope_parameters["full_attention"]``, "proportional" over half of each head by
default); per-head q/k norms and a sigmoid gate per head from the layer's input (``gate_proj``, where
``use_attention_gate``); sandwich norms where ``use_sandwich_norm`` (``post_operator_norm``, ``post_ffn_norm``); a
SwiGLU MLP of ``intermediate_size`` as given."""

from kvserve.model.architectures import Architecture, first_of, register
from kvserve.model.architectures.lfm2 import LFM2_WEIGHTS
from kvserve.model.config import SLIDING


def lfm3_config(d: dict) -> dict:
    layers = d["num_hidden_layers"]
    kinds = d.get("layer_types") or ["full_attention" if i % 4 == 2 else SLIDING if i % 4 == 0 and i > 0 else "conv"
                                     for i in range(layers)]
    unknown = sorted(set(kinds) - {"conv", "full_attention", SLIDING})
    if unknown:
        raise ValueError(f"LFM3 layer types {unknown} are not supported (conv, full_attention, sliding_attention)")
    local = ((d.get("rope_parameters") or {}).get(SLIDING) or {}).get("rope_theta", 10000.0)
    gated = bool(d.get("use_attention_gate", True))
    if gated and d.get("attention_bias"):  # (the gate would share q's bias: one GEMM, one bias for all of its rows)
        raise ValueError("Lfm3ForCausalLM with attention_bias and use_attention_gate (q/k/v/o biased, the gate not) is "
                         "not supported")
    return {"conv_layers": [k == "conv" for k in kinds], "conv_kernel": int(d.get("conv_L_cache", 7)),
            "conv_bias": bool(d.get("conv_bias", False)), "qk_norm": "head",
            "intermediate_size": d["intermediate_size"],
            "rms_norm_eps": float(first_of(d, "norm_eps", "rms_norm_eps", default=1e-5)),
            "tie_word_embeddings": bool(first_of(d, "tie_embedding", "tie_word_embeddings", default=True)),
            "norm_layout": "sandwich" if d.get("use_sandwich_norm", True) else "pre",
            "layer_types": list(kinds), "sliding_window": d.get("sliding_window") if SLIDING in kinds else None,
            "rope_local_theta": float(local) if SLIDING in kinds else None,
            "attn_output_gate": gated, "attn_output_gate_per_head": gated}


register(Architecture("Lfm3ForCausalLM", lfm3_config, weights={
    **LFM2_WEIGHTS, "o_proj": "self_attn.o_proj", "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm",
    "attn_gate_proj": "self_attn.gate_proj", "attn_out_norm": "post_operator_norm", "mlp_out_norm": "post_ffn_norm"},
    prefixes={"model.embedding_norm.": "model.norm.", "model.": "model.", "lm_head.": "lm_head."}))
