"""A.X-K2 (SK Telecom): DeepSeek-V3.2's latent attention with its lightning indexer, q's expansion reading the normed
and the raw q latent side by side and giving each head its q and a sigmoid gate on its output (``q_b_proj``,
transformers' ``q_gate_proj``:
``ModelConfig.latent_q_gate``); the input norm of every layer and the MLP norm of the MoE layers gated by a low-rank
MLP of their output (``gated_norm_rank``); DeepSeek-V3's sigmoid router with its bias, dense or sparse layers by
``mlp_layer_types``, from the best ``topk_group`` of ``n_group`` expert groups where set (the larger releases: the
other groups' experts scored 0, not -inf)."""

from kvserve.model.architectures import Architecture, register
from kvserve.model.architectures.deepseek_v2 import DEEPSEEK_WEIGHTS
from kvserve.model.architectures.deepseek_v3 import v3_experts
from kvserve.model.architectures.deepseek_v32 import indexed_latent_config


def axk2_config(d: dict) -> dict:
    kinds = d.get("mlp_layer_types")
    if kinds is None:  # the legacy keys, as transformers' config reads them
        dense, every = d.get("first_k_dense_replace", 1), d.get("moe_layer_freq") or 1
        kinds = ["sparse" if i >= dense and i % every == 0 else "dense" for i in range(d["num_hidden_layers"])]
    return {**indexed_latent_config(d, False, 16), **v3_experts(d, [kind == "sparse" for kind in kinds]),
            "group_scoring": "top2_zero", "latent_q_gate": True, "norm_gate_rank": d.get("gated_norm_rank", 16)}


register(Architecture("AXK2ForCausalLM", axk2_config, weights=DEEPSEEK_WEIGHTS,
                      # a gated norm's weight and its gate's MLP (the released names, W_down/W_up, or transformers'
                      # mlp.fc1/fc2), and q's expansion (transformers' q_gate_proj), as the table names them
                      renames={"layernorm.norm.": "layernorm.", "layernorm.W_down.": "layernorm.gate_in.",
                               "layernorm.W_up.": "layernorm.gate_out.", "layernorm.mlp.fc1.": "layernorm.gate_in.",
                               "layernorm.mlp.fc2.": "layernorm.gate_out.", "self_attn.q_gate_proj.":
                               "self_attn.q_b_proj."}))
