"""DeepSeek-V3.2 (DeepseekV32ForCausalLM): DeepSeek-V3's latent attention (q always from its latent, rotary pairs
interleaved) and router, its layers dense or sparse by ``mlp_layer_types`` (else the first ``first_k_dense_replace``
dense), with DeepSeek Sparse Attention: a lightning indexer in every layer picks each query's ``index_topk`` keys
(``ModelConfig.index_topk``; its own rotary on halves), attended on the general torch path once a context is longer
than that (the native decode stack refuses it). The MTP layers are not read."""

from kvserve.model.architectures import Architecture, register
from kvserve.model.architectures.deepseek_v2 import DEEPSEEK_WEIGHTS, latent_attention_config
from kvserve.model.architectures.deepseek_v3 import v3_experts


def sparse_layers(d: dict, dense_default: int) -> list[bool]:
    """``mlp_layer_types``' "sparse" layers, else all but the first ``first_k_dense_replace``."""
    kinds = d.get("mlp_layer_types")
    if kinds is None:
        dense = d.get("first_k_dense_replace", dense_default)
        return [i >= dense for i in range(d["num_hidden_layers"])]
    return [kind == "sparse" for kind in kinds]


def indexed_latent_config(d: dict, index_pairs: bool, heads_default: int) -> dict:
    """Latent attention with rotary pairs and a lightning indexer (``index_pairs``: its rotary on pairs; transformers'
    default index heads ``heads_default``), over
    DeepSeek-V3's experts: what DeepSeek-V3.2 and GLM-5 share."""
    if not d.get("q_lora_rank"):
        raise ValueError(f"{d['architectures'][0]} without q_lora_rank (its indexer reads q's latent) is not supported")
    return {**latent_attention_config({**d, "rope_interleave": True}), **v3_experts(d, sparse_layers(d, 3)),
            "index_topk": d.get("index_topk", 2048), "index_heads": d.get("index_n_heads", heads_default),
            "index_head_dim": d.get("index_head_dim", 128), "index_rope_interleaved": index_pairs,
            "mlp_bias": False}  # (their configs take mlp_bias; transformers builds no MLP bias from it)


register(Architecture("DeepseekV32ForCausalLM", lambda d: indexed_latent_config(d, False, 64), weights=DEEPSEEK_WEIGHTS))
