"""RecurrentGemma (Griffin): ``block_types`` repeated over the layers, each a recurrent block (``kvserve.model.rglru``:
the RG-LRU after a short convolution, gated by a GELU-tanh branch) or local attention (every attention layer sliding
over ``attention_window_size``, rotary on half of each head, o_proj with a bias); Gemma's norms (1 + weight), a gated
GELU-tanh MLP of half ``intermediate_size`` with biases, embeddings times sqrt(hidden) as a bf16 number, soft-capped
logits, tied embeddings."""

import struct

from kvserve.model.architectures import Architecture, register
from kvserve.model.config import SLIDING


def bf16_round(x: float) -> float:
    """``x`` rounded to bfloat16 (to nearest, ties to even), as transformers keeps the embeddings' normalizer."""
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def recurrent_gemma_config(d: dict) -> dict:
    layers, hidden, heads = d["num_hidden_layers"], d["hidden_size"], d["num_attention_heads"]
    kinds = (list(d.get("block_types") or ("recurrent", "recurrent", "attention")) * layers)[:layers]
    if set(kinds) - {"recurrent", "attention"}:
        raise ValueError(f"RecurrentGemma block types {sorted(set(kinds))}: only recurrent and attention are known")
    rope = d.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default" or d.get("rope_scaling"):
        raise ValueError("RecurrentGemma's rotary is the default one only (no rope scaling)")
    partial = d.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 0.5
    return {"norm_offset": 1.0, "hidden_act": d.get("hidden_activation") or "gelu_pytorch_tanh",
            "embed_scale": bf16_round(float(hidden) ** 0.5), "tie_word_embeddings": d.get("tie_word_embeddings", True),
            "intermediate_size": d["intermediate_size"] // 2, "mlp_bias": True, "o_proj_bias": True,
            "head_dim": hidden // heads, "partial_rotary_factor": float(partial),
            "sliding_window": int(d.get("attention_window_size") or 2048),
            "layer_types": [SLIDING if k == "attention" else "recurrent" for k in kinds],
            "lru_layers": [k == "recurrent" for k in kinds], "lru_width": int(d.get("lru_width") or hidden),
            "lru_blocks": heads, "lru_conv_kernel": int(d.get("conv1d_width", 4)),
            "final_logit_softcap": d.get("logits_soft_cap", 30.0), "rms_norm_eps": float(d.get("rms_norm_eps", 1e-6))}


register(Architecture("RecurrentGemmaForCausalLM", recurrent_gemma_config, renames={"model.final_norm.": "model.norm."},
                      weights={"input_layernorm": "temporal_pre_norm", "post_attention_layernorm": "channel_pre_norm",
                               "q_proj": "temporal_block.q_proj", "k_proj": "temporal_block.k_proj",
                               "v_proj": "temporal_block.v_proj", "o_proj": "temporal_block.o_proj",
                               "gate_proj": "mlp_block.gate_proj", "up_proj": "mlp_block.up_proj",
                               "down_proj": "mlp_block.down_proj", "lru_x": "temporal_block.linear_x",
                               "lru_y": "temporal_block.linear_y", "lru_out": "temporal_block.linear_out",
                               "lru_conv": "temporal_block.conv_1d", "lru": "temporal_block.rg_lru"}))
