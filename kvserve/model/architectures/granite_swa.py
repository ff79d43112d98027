"""Granite SWA (granite-swash): Granite's four multipliers with sliding-window layers (``layer_types``; by default
every fourth layer from the first attends globally), a learned sink logit per head (gpt-oss's ``attn_sinks``: the
eager path's ``sigmoid(lse - sink)`` output scale is the same softmax with one more logit), and a RoPE base per layer
(``layer_rope_theta``; 0: no rotary). Two distinct bases at most: the global one, and a second as the local rotary
(``rope_local_layers``, scaled as the global one is). Granite MoE SWA: the same attention in Granite MoE Shared's
layers (its shared expert off where ``shared_intermediate_size`` is 0), its experts stored as transformers 5 names
them."""

from kvserve.model.architectures import Architecture, StackedExperts, register
from kvserve.model.architectures.granite import granite_config
from kvserve.model.architectures.granite_moe import WEIGHTS, granite_moe_shared_config
from kvserve.model.config import FULL, SLIDING, rope_settings


def swa_attention(d: dict) -> dict:
    """The windows, sinks and per-layer rotary bases both Granite SWA architectures read."""
    layers = d["num_hidden_layers"]
    types = d.get("layer_types") or [FULL if i % 4 == 0 else SLIDING for i in range(layers)]
    theta = float(rope_settings(d)[0] or 10000.0)
    bases = [float(t) for t in (d.get("layer_rope_theta") or [theta] * layers)]
    distinct = sorted({t for t in bases if t})
    if len(distinct) > 2:
        raise ValueError(f"layer_rope_theta has {len(distinct)} distinct bases; kvserve rotates by two at most")
    main = theta if theta in distinct or not distinct else distinct[0]
    out = {"layer_types": list(types), "sliding_window": d.get("sliding_window") or None, "attn_sinks": True,
           "rope_theta": main}
    if 0.0 in bases:  # NoPE layers
        out["rope_layers"] = [t != 0 for t in bases]
    local = [t for t in distinct if t != main]
    if local:
        out.update(rope_local_theta=local[0], rope_local_layers=[t == local[0] for t in bases], rope_local_scaled=True)
    return out


register(Architecture("GraniteSWAForCausalLM", lambda d: {**granite_config(d), **swa_attention(d)}))
# transformers 5's expert layout (no legacy names to convert from): [experts, 2 * inter, hidden], gate's rows first
MOE_EXPERTS = StackedExperts(gate_up="block_sparse_moe.experts.gate_up_proj", down="block_sparse_moe.experts.down_proj",
                             interleaved=False, transposed=False)
register(Architecture("GraniteMoeSWAForCausalLM", lambda d: {**granite_moe_shared_config(d), **swa_attention(d)},
                      weights={**WEIGHTS, "router": "block_sparse_moe.router"}, stacked_experts=MOE_EXPERTS))
