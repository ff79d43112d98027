"""CodeGen (1, 2; 350M-16B): GPT-J's layers (one LayerNorm before attention and the MLP side by side, rotary over the
first ``rotary_dim`` dims of each head on interleaved pairs, a non-gated GELU MLP with biases, no attention biases,
the LM head's bias) with q/k/v in one tensor (``qkv_proj``) laid out for 4-way model parallelism: 4 blocks of rows,
each holding its quarter of q's rows, then of v's, then of k's. The loader reorders them to q's, k's, v's
(``adjust_weights``) and the interleaved rotary pairs as every model's (``weight_layout.deinterleave_rotary``)."""

from typing import Any

from kvserve.model.architectures import Architecture, register
from kvserve.model.architectures.gpt2 import gpt2_keys
from kvserve.model.architectures.gpt_neox import gptj_config

MP_BLOCKS = 4  # the model-parallel blocks CodeGen's qkv_proj is laid out in (transformers' mp_num)


def codegen_config(d: dict) -> dict:
    if d["hidden_size"] % MP_BLOCKS:
        raise ValueError(f"CodeGen's hidden_size must split into {MP_BLOCKS} model-parallel blocks")
    return {**gptj_config(d), "o_proj_bias": False, "attention_bias": False}


def ungroup_codegen_qkv(cfg: Any, weights: dict[str, Any]) -> dict[str, Any]:
    """Each layer's qkv_proj rows from CodeGen's blocks ([q, v, k] quarters, block by block) to q's, k's, v's."""
    for i in range(cfg.num_hidden_layers):
        name = f"model.layers.{i}.attn.qkv_proj.weight"
        if name in weights:
            w = weights[name]
            blocks = w.reshape(MP_BLOCKS, 3, -1, w.shape[-1])  # [block, (q, v, k), rows, hidden]
            weights[name] = blocks[:, [0, 2, 1]].transpose(0, 1).reshape(w.shape).contiguous()
    return weights


register(Architecture("CodeGenForCausalLM", codegen_config, adjust_weights=ungroup_codegen_qkv,
                      text_config=lambda d: {**gpt2_keys(d), "tie_word_embeddings": bool(d.get("tie_word_embeddings"))},
                      weights={"input_layernorm": "ln_1", "qkv_proj": "attn.qkv_proj", "o_proj": "attn.out_proj",
                               "gate_proj": None, "up_proj": "mlp.fc_in", "down_proj": "mlp.fc_out"},
                      prefixes={"transformer.wte.": "model.embed_tokens.", "transformer.h.": "model.layers.",
                                "transformer.ln_f.": "model.norm.", "lm_head.": "lm_head."}))
