"""NanoChat (karpathy/nanochat): RMSNorms without weights (``norm_affine`` False) before each sublayer, on the
embeddings (``embed_norm``: the final norm's module applied there too) and at the end; q and k RMS-normed per head
without weights after rotary; a non-gated relu2 MLP (``fc1``, ``fc2``); the logits soft-capped
(``final_logit_softcapping``). Its rotary turns the other way (sin negated: the first half gets + x2 sin, the
second - x1 sin); q and k with the second half of each head's rotating dims negated rotate the usual way into the same
vectors but for that half's sign, which q . k and the per-head norm do not see: the rows are negated at load
(``adjust_weights``), so every rotary path runs it."""

from typing import Any

from kvserve.model.architectures import Architecture, first_of, register


def nanochat_config(d: dict) -> dict:
    return {"norm_affine": False, "embed_norm": True, "rms_norm_eps": float(d.get("rms_norm_eps", 1e-6)),
            "qk_norm": "head", "qk_norm_type": "unweighted", "qk_norm_after_rope": True, "gated_mlp": False,
            "hidden_act": d.get("hidden_act") or "relu2",
            "final_logit_softcap": first_of(d, "final_logit_softcapping", default=None)}


def negate_rotary_halves(cfg: Any, weights: dict[str, Any]) -> dict[str, Any]:
    """q_proj's and k_proj's rows (and biases) of the second half of each head's rotating dims, negated."""
    d, rot = int(cfg.head_dim), cfg.rotary_dim
    for i in range(cfg.num_hidden_layers):
        for name, heads in (("q_proj", cfg.num_attention_heads), ("k_proj", cfg.num_key_value_heads)):
            for suffix in ("weight", "bias"):
                key = f"model.layers.{i}.self_attn.{name}.{suffix}"
                if key not in weights:
                    continue
                t = weights[key].clone()
                rows = t.view(heads, d, *t.shape[1:])
                rows[:, rot // 2: rot] *= -1
                weights[key] = t
    return weights


register(Architecture("NanoChatForCausalLM", nanochat_config, adjust_weights=negate_rotary_halves,
                      weights={"gate_proj": None, "up_proj": "mlp.fc1", "down_proj": "mlp.fc2"}))
