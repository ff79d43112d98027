"""HyperCLOVA X SEED (Think 14B): Granite's embedding, residual and attention multipliers, the logits multiplied by
``logits_scaling`` (not divided, as Granite's are), and where ``use_post_norm`` (the default) an RMSNorm on each
sublayer's output before its residual scale (Peri-LN: the sandwich layout, ``post_norm1``/``post_norm2``)."""

from kvserve.model.architectures import Architecture, register
from kvserve.model.architectures.granite import granite_config


def hyperclovax_config(d: dict) -> dict:
    head_dim = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
    multiplier = d.get("attention_multiplier")
    return {**granite_config(d), "attn_scale": float(head_dim ** -0.5 if multiplier is None else multiplier),
            "logit_scale": float(d.get("logits_scaling", 1.0)),
            "norm_layout": "sandwich" if d.get("use_post_norm", True) else "pre"}


register(Architecture("HyperCLOVAXForCausalLM", hyperclovax_config,
                      weights={"attn_out_norm": "post_norm1", "mlp_out_norm": "post_norm2"}))
