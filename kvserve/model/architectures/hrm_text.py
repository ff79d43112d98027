"""HRM-Text: two stacks of Llama-like layers (weightless RMSNorms, full multi-head attention gated by sigmoid of a
projection of its own, q/k/v and the gate in one tensor ``attn.gqkv_proj``, gate and up in ``mlp.gate_up_proj``) run in
cycles over two streams (``kvserve.model.cycles``): per high cycle, ``L_cycles`` passes of the low stack, then one of
the high stack; embeddings times ``embedding_scale``, no final norm but each pass's own. Every pass is its own layers
(``num_hidden_layers``: the config's unrolled count), the stack's weights read once and repeated. Served causally:
``prefix_lm``'s bidirectional prompt block needs ``token_type_ids``, which an engine request does not carry
(transformers' generate without them attends causally too)."""

from typing import Any, Sequence

from kvserve.model.architectures import Architecture, register


def hrm_config(d: dict) -> dict:
    per_stack, high, low = d["num_layers_per_stack"], d.get("H_cycles", 2), d.get("L_cycles", 3)
    if d["num_hidden_layers"] != per_stack * high * (low + 1):
        raise ValueError("HrmTextForCausalLM: num_hidden_layers is not num_layers_per_stack x H_cycles x "
                         "(L_cycles + 1)")
    scale = d.get("embedding_scale") or 1.0 / d.get("initializer_range", 0.02)
    return {"norm_affine": False, "final_norm": False, "attn_output_gate": True, "embed_scale": float(scale),
            "stack_cycles": (per_stack, high, low), "checkpoint_layers": source_layers(per_stack, high, low)}


def source_layers(per_stack: int, high: int, low: int) -> list[int]:
    """Each unrolled layer's stack layer: the low stack's j as j, the high stack's j as per_stack + j."""
    return [(per_stack if k % (low + 1) == low else 0) + j for k in range(high * (low + 1)) for j in range(per_stack)]


def repeat_stacks(cfg: Any, weights: dict[str, Any]) -> dict[str, Any]:
    """Every pass's layers given their stack's tensors (read once, for its first pass); the gate's rows of the fused
    projection (the checkpoint's first) moved behind q's, where gated attention takes them."""
    layers = list(cfg.checkpoint_layers)
    rows = cfg.num_attention_heads * int(cfg.head_dim)
    for i, source in enumerate(layers):
        first = layers.index(source)
        name = f"model.layers.{i}.attn.gqkv_proj.weight"
        if i == first and name in weights:
            w = weights[name]
            weights[name] = w[[*range(rows, 2 * rows), *range(rows), *range(2 * rows, w.shape[0])]]
        if i != first:
            head = f"model.layers.{first}."
            for key in [k for k in weights if k.startswith(head)]:
                weights[f"model.layers.{i}." + key[len(head):]] = weights[key]
    return weights


class HrmArchitecture(Architecture):
    """Reads the two stacks' layers (``model.L_module.layers.{j}``, ``model.H_module.layers.{j}``) as the unrolled
    layers' first passes (``checkpoint_layers``: the high stack's j as per_stack + j)."""

    def checkpoint_name(self, name: str, layers: Sequence[int] | None = None) -> str | None:
        if layers is not None:
            per_stack = (max(layers) + 1) // 2
            for stack, offset in (("model.L_module.layers.", 0), ("model.H_module.layers.", per_stack)):
                if name.startswith(stack):
                    index, _, rest = name[len(stack):].partition(".")
                    name = f"model.layers.{int(index) + offset}.{rest}"
        return super().checkpoint_name(name, layers)


register(HrmArchitecture("HrmTextForCausalLM", hrm_config, adjust_weights=repeat_stacks, weights={
    "qkv_proj": "attn.gqkv_proj", "o_proj": "attn.o_proj", "gate_up_proj": "mlp.gate_up_proj",
    # (the gate's rows are in gqkv_proj: a name of its own only so that they are not read as q's interleaved)
    "attn_gate_proj": "attn.gate_proj"}))
