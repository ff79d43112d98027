"""Granite 3.x MoE: Granite's four multipliers with a top-k mixture of experts in every layer (softmax over the
chosen logits, so renormalised), the experts stored stacked as linear weights: gate's rows then up's in
``input_linear``, ``output_linear`` the down projections. llama.cpp's "granitemoe" files: gate, up and down
per expert tensor, Granite's multiplier keys."""

from kvserve.model.architectures import Architecture, StackedExperts, first_of, register
from kvserve.model.architectures.granite import granite_config, granite_gguf


def granite_moe_config(d: dict) -> dict:
    return {**granite_config(d), "num_experts": first_of(d, "num_local_experts", "num_experts"),
            "num_experts_per_tok": d["num_experts_per_tok"], "moe_intermediate_size": d["intermediate_size"],
            "norm_topk_prob": True}


register(Architecture("GraniteMoeForCausalLM", granite_moe_config, weights={"router": "block_sparse_moe.router.layer"},
                      stacked_experts=StackedExperts(gate_up="block_sparse_moe.input_linear.weight",
                                                     down="block_sparse_moe.output_linear.weight",
                                                     interleaved=False, transposed=False),
                      gguf="granitemoe", gguf_permuted=True, gguf_config=granite_gguf))
