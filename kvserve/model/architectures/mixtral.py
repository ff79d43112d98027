"""Mixtral: Mistral with a top-k mixture of experts in every layer (the chosen experts' weights renormalised)."""

from kvserve.model.architectures import Architecture, first_of, register


def mixtral_config(d: dict) -> dict:
    return {"sliding_window": d.get("sliding_window") or None, "num_experts": first_of(d, "num_local_experts", "num_experts"),
            "num_experts_per_tok": d["num_experts_per_tok"], "moe_intermediate_size": d["intermediate_size"],
            "norm_topk_prob": True}


MIXTRAL_WEIGHTS = {"router": "block_sparse_moe.gate", "expert": "block_sparse_moe.experts.{e}.",
                   "expert_gate": "w1", "expert_up": "w3", "expert_down": "w2"}

register(Architecture("MixtralForCausalLM", mixtral_config, weights=MIXTRAL_WEIGHTS))
