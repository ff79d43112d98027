"""RWKV-4 (RWKV Pile and Raven checkpoints): each block a time mix and a channel mix, each after its own LayerNorm
(``kvserve.model.rwkv``), built as two of the decoder's layers (a checkpoint block holds both: ``sublayers`` 2); no
attention, no positions; a LayerNorm on the embeddings (the first block's ``pre_ln``) and after the last block
(``ln_out``); ``rwkv.`` names, the LM head ``head``."""

from kvserve.model.architectures import Architecture, register
from kvserve.model.architectures.mamba2 import without_attention


def rwkv_config(d: dict) -> dict:
    blocks, hidden = d["num_hidden_layers"], d["hidden_size"]
    eps = float(d.get("layer_norm_epsilon", 1e-5))
    if eps != 1e-5:  # transformers' final norm keeps torch's default whatever the config says
        raise ValueError(f"RWKV with layer_norm_epsilon {eps}: only 1e-5 is supported (ln_out's own)")
    return {"num_hidden_layers": 2 * blocks, "rwkv_mix": ["time", "channel"] * blocks,
            "layer_parts": ["mixer"] * (2 * blocks),
            "rwkv_attention_size": int(d.get("attention_hidden_size") or hidden),
            "intermediate_size": int(d.get("intermediate_size") or 4 * hidden), "norm_type": "layer",
            "rms_norm_eps": eps, "embed_norm": True,
            "max_position_embeddings": int(d.get("context_length") or d.get("max_position_embeddings") or 1024)}


# (rescale_every, which transformers applies in eval: out_proj weights halved every rescale_every blocks and the stream
# with them, an fp16 overflow guard; the same function up to the LayerNorms' eps, so the weights are read as stored)
register(Architecture("RwkvForCausalLM", rwkv_config, text_config=without_attention, sublayers=2,
                      prefixes={"rwkv.blocks.0.pre_ln.": "model.embed_norm.", "rwkv.embeddings.": "model.embed_tokens.",
                                "rwkv.ln_out.": "model.norm.", "rwkv.blocks.": "model.layers.", "head.": "lm_head."},
                      renames={".ln1.": ".ln_0.", ".ln2.": ".ln_1."},
                      weights={"input_layernorm": "ln_{s}", "rwkv_time": "attention", "rwkv_channel": "feed_forward"}))
