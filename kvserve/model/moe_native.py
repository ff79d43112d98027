"""An MoE block's experts on the native kernels: ``native_moe_block`` gathers a ``MoE``'s router, its routed
experts' packed quantized weights (and biases, activation, shared expert) into one ``kvserve.MoEBlock``
(kvserve/kernels/csrc/model/moe_block.h), which ``MoE.forward`` and the native decode stack both run."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from kvserve.kernels import ops
from kvserve.model.config import NATIVE_ACTIVATIONS
from kvserve.model.quant_linear import QuantLinear

if TYPE_CHECKING:
    from kvserve.model.mlp import GatedMLP, MoE


def _packed(mlp: "GatedMLP") -> bool:
    return all(type(m) is QuantLinear and m.packed is not None for m in (mlp.gate_up, mlp.down))


def moe_blocker(moe: "MoE") -> str | None:
    """None when ``moe`` can run as a native block; else why not (the weights, the activation or the kernels)."""
    if not ops.available():
        return "no native kernels"
    if moe.gates is None:
        moe.keep_gates()  # its linears are still nn.Linear (not packed for oneDNN)
    assert moe.gates is not None
    if moe.gates[0].dtype != torch.float32:
        return "a non-float32 router"
    mlps = list(moe.experts) + ([moe.shared] if moe.shared is not None else [])
    if not all(_packed(m) for m in mlps):
        return "experts not on the packed quantized kernels"
    if moe.scoring == "sparsemixer":
        return "the sparsemixer router"
    act = moe.experts[0]
    if not act.gated:
        return "experts without a gate"
    if moe.groups is not None and moe.groups[2] not in ("max", "top2"):
        return "expert groups scored 0 outside the chosen ones"
    if moe.expert_norms is not None:
        return "norms on the experts' outputs"
    if moe.scale_inputs:
        return "experts scaling their inputs"
    if moe.logit_softcap is not None:
        return "a soft cap on the router's logits"
    if moe.bias_on_logits:  # the block adds the selection bias to the scores
        return "a selection bias on the router's logits"
    if moe.identity_experts:
        return "identity experts"
    if any(m.clip is not None for m in mlps):
        return "SwiGLU clipped after the activation"
    if act.swiglu is None and act.act_name not in NATIVE_ACTIVATIONS:
        return f"the activation {act.act_name}"
    return None


def native_moe_block(moe: "MoE") -> Any | None:
    """The ``MoEBlock`` over ``moe``'s weights (shared with its modules, not copied), or None (``moe_blocker``)."""
    if moe_blocker(moe) is not None:
        return None
    first = moe.experts[0]
    act = "swiglu" if first.swiglu is not None else NATIVE_ACTIVATIONS[first.act_name]
    alpha, limit = first.swiglu if first.swiglu is not None else (1.0, None)
    assert moe.gates is not None
    router, bias, gate = moe.gates
    block = ops.moe_block(router.shape[1], moe.top_k, moe.norm_topk, act, alpha, limit or 0.0)
    block.set_router(router, bias)
    block.set_scoring(moe.scoring == "sigmoid", moe.routed_scale)
    if moe.groups is not None:
        groups, used, scoring = moe.groups
        block.set_groups(groups, used, scoring == "top2")
    if moe.selection_bias is not None:
        block.set_selection_bias(moe.selection_bias.detach().float().reshape(-1).contiguous())
    for e in moe.experts:
        block.add_expert(e.gate_up.packed, e.gate_up.kind, e.down.packed, e.down.kind, e.gate_up.bias, e.down.bias)
    if moe.shared is not None:  # gate None: the shared expert added unweighted
        s = moe.shared
        block.set_shared(s.gate_up.packed, s.gate_up.kind, s.down.packed, s.down.kind, gate)
    return block
