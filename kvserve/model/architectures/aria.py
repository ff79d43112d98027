"""Aria (text model, and the multimodal checkpoints read as it): Llama's attention with experts in every layer: the
router's top ``moe_topk`` logits softmaxed among themselves (a softmax renormalised over the chosen), SiLU experts
stored stacked as [experts, in, out] (``fc1``: gate's columns then up's; ``fc2``), beside ``moe_num_shared_experts``
shared experts that act as one dense MLP of that many times ``intermediate_size``, added without a gate. Image inputs
are not supported: the vision tower and projector of ``AriaForConditionalGeneration`` are not read."""

from kvserve.model.architectures import Architecture, StackedExperts, register
from kvserve.model.architectures.gemma3_mm import MULTIMODAL_PREFIXES, text_part


def aria_config(d: dict) -> dict:
    # the routed experts are SiLU whatever hidden_act says (the shared ones follow it): one activation here for both
    if (d.get("hidden_act") or "silu") != "silu":
        raise ValueError(f"Aria with hidden_act {d['hidden_act']} (its shared experts unlike its routed SiLU ones) "
                         "is not supported")
    inter = d["intermediate_size"]
    return {"num_experts": d.get("moe_num_experts") or 8, "num_experts_per_tok": d.get("moe_topk") or 2,
            "moe_intermediate_size": inter, "norm_topk_prob": True,
            "shared_expert_intermediate_size": inter * (d.get("moe_num_shared_experts") or 0),
            "shared_expert_gated": False}


WEIGHTS = {"router": "mlp.router", "shared_expert": "mlp.shared_experts."}
EXPERTS = StackedExperts(gate_up="mlp.experts.fc1.weight", down="mlp.experts.fc2.weight", interleaved=False,
                         transposed=True)
register(Architecture("AriaTextForCausalLM", aria_config, weights=WEIGHTS, stacked_experts=EXPERTS))
register(Architecture("AriaForConditionalGeneration", aria_config, weights=WEIGHTS, stacked_experts=EXPERTS,
                      text_config=text_part, prefixes=MULTIMODAL_PREFIXES))
