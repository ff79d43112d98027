"""Kolibri-1.1 (Aleph Alpha): Kolibri-1's sandwich layers and router over sliding layers (rotary, a window) and
indexed ones (no positions, the whole context, their K and V rounded to NVFP4's values: ``ModelConfig.kv_nvfp4``),
some of which attend over an earlier indexed layer's K/V (``kv_source_layers``: ``kv_shared_from``, no k/v projections
of their own); a dense MLP (``mlp_only_intermediate_size``) on ``mlp_only_layers``, experts elsewhere. The indexed
layers' key selection (each query's ``index_topk`` best keys of its pool, besides sink and local tokens) only bites once
a query sees more than topk + local + sink keys: the context window is capped there (``max_position_embeddings``), so
that every query attends all it sees, as the reference does below that length."""

import logging

from kvserve.model.architectures import Architecture, register
from kvserve.model.architectures.kolibri1 import kolibri1_config
from kvserve.model.config import FULL, SLIDING

log = logging.getLogger(__name__)
INDEXED = "indexed_attention"


def kolibri1_1_config(d: dict) -> dict:
    layers = d["num_hidden_layers"]
    types = d.get("layer_types") or [INDEXED if (i + 1) % 5 == 0 else SLIDING for i in range(layers)]
    if set(types) - {INDEXED, SLIDING}:
        raise ValueError(f"Kolibri1_1ForCausalLM with layer types {sorted(set(types))} is not supported")
    sources = d.get("kv_source_layers")
    if sources is None:  # transformers' default: of the indexed layers, the 2nd, 3rd and 10th on the 1st's, ...
        indexed = [i for i, t in enumerate(types) if t == INDEXED]
        defaults = (0, 0, 0, 3, 4, 5, 5, 5, 5, 0)
        if len(indexed) > len(defaults):
            raise ValueError("Kolibri1_1ForCausalLM with more indexed layers than its default layout needs "
                             "kv_source_layers")
        sources = list(range(layers))
        for i, k in zip(indexed, defaults):
            sources[i] = indexed[k]
    dense = d.get("mlp_only_layers")
    dense = [i for i in (0, 1) if i < layers] if dense is None else dense
    full = [FULL if t == INDEXED else SLIDING for t in types]
    out = {**kolibri1_config({**d, "layer_types": full}), "kv_shared_from": list(sources), "kv_nvfp4": True,
           "moe_layers": [i not in dense for i in range(layers)],
           "intermediate_size": d.get("mlp_only_intermediate_size") or d.get("intermediate_size") or 0}
    budget = d.get("index_topk", 2048) + d.get("index_num_local_tokens", 128) + d.get("index_num_sink_tokens", 8)
    mpe = d.get("max_position_embeddings", 4096)
    if INDEXED in types and mpe > budget:
        log.warning("Kolibri1_1ForCausalLM: the context window capped at %d tokens (index_topk + local + sink), past "
                    "which its indexed layers would select keys (not supported)", budget)
        out["max_position_embeddings"] = budget
    return out


register(Architecture("Kolibri1_1ForCausalLM", kolibri1_1_config, weights={
    "attn_out_norm": "post_attn_norm", "mlp_out_norm": "post_ffn_norm", "shared_expert": "mlp.shared_experts.",
    "selection_bias": "moe.router.expert_bias"}))
