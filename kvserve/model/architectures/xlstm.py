"""xLSTM (xLSTM-7b): every block an RMSNorm and an mLSTM layer (``kvserve.model.mlstm``), then an RMSNorm and a SiLU
gated MLP (``proj_up_gate``, ``proj_up``, ``proj_down``) of hidden x ``ffn_proj_factor`` rounded up to
``ffn_round_up_to_multiple_of``; no attention, no positions; the final ``out_norm`` (always, as transformers builds it),
soft-capped logits; ``backbone.`` names. Only ``weight_mode`` "single" (a tensor a projection) and no biases."""

from kvserve.model.architectures import Architecture, register
from kvserve.model.architectures.mamba2 import without_attention
from kvserve.model.config import MLSTMShape


def round_up(x: float, multiple: int) -> int:
    """x rounded up to a multiple (transformers' arithmetic, on the float)."""
    return int(((x + multiple - 1) // multiple) * multiple)


def xlstm_text(d: dict) -> dict:
    """The common keys from xLSTM's own names (``embedding_dim``, ``num_blocks``), one nominal head."""
    return without_attention({**d, "hidden_size": d.get("hidden_size") or d["embedding_dim"],
                              "num_hidden_layers": d.get("num_hidden_layers") or d["num_blocks"]})


def xlstm_config(d: dict) -> dict:
    if d.get("weight_mode", "single") != "single":
        raise ValueError(f"xLSTM weight_mode {d['weight_mode']!r} is not supported (single)")
    if d.get("use_bias"):
        raise ValueError("xLSTM with use_bias is not supported (norms and projections with biases)")
    hidden, heads = d["hidden_size"], int(d.get("num_heads", 8))
    cap = d.get("gate_soft_cap", 15.0)  # (transformers' defaults where a key is absent; null: no cap)
    qk, v = int(hidden * d.get("qk_dim_factor", 0.5)), int(hidden * d.get("v_dim_factor", 1.0))
    return {"mlstm": MLSTMShape(heads, qk, v, None if cap is None else float(cap), float(d.get("eps", 1e-6)),
                                float(d.get("norm_eps", 1e-6))),
            "intermediate_size": round_up(hidden * d.get("ffn_proj_factor", 2.667),
                                          int(d.get("ffn_round_up_to_multiple_of", 64))),
            "rms_norm_eps": float(d.get("norm_eps", 1e-6)),
            "final_logit_softcap": d.get("output_logit_soft_cap", 30.0),
            "tie_word_embeddings": False}  # (transformers never ties xLSTM's head, whatever the config says)


register(Architecture("xLSTMForCausalLM", xlstm_config, text_config=xlstm_text,
                      prefixes={"backbone.embeddings.": "model.embed_tokens.", "backbone.out_norm.": "model.norm.",
                                "backbone.blocks.": "model.layers.", "lm_head.": "lm_head."},
                      weights={"input_layernorm": "norm_mlstm", "post_attention_layernorm": "norm_ffn",
                               "gate_proj": "ffn.proj_up_gate", "up_proj": "ffn.proj_up", "down_proj": "ffn.proj_down",
                               "mlstm_q": "mlstm_layer.q", "mlstm_k": "mlstm_layer.k", "mlstm_v": "mlstm_layer.v",
                               "mlstm_ogate": "mlstm_layer.ogate_preact", "mlstm_igate": "mlstm_layer.igate_preact",
                               "mlstm_fgate": "mlstm_layer.fgate_preact", "mlstm_norm": "mlstm_layer.multihead_norm",
                               "mlstm_out": "mlstm_layer.out_proj"}))
