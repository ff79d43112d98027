"""llama.cpp's tensor names and the checkpoint names kvserve reads, both ways: ``gguf_to_hf_name`` for the
GGUF loader, ``hf_to_gguf_name`` (its inverse) for writing GGUF files (``scripts/write_bench_gguf.py``).
An architecture's own leaves are its ``Architecture.gguf_roles``."""

from __future__ import annotations

from kvserve.model.architectures import LLAMA_WEIGHTS, Architecture, get_architecture

_GGUF_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# llama.cpp's names for a layer's tensors -> our roles (``LLAMA_WEIGHTS``), which the architecture names
_GGUF_LAYER_ROLES = {
    "attn_norm": "input_layernorm",
    "attn_q": "q_proj",
    "attn_k": "k_proj",
    "attn_v": "v_proj",
    "attn_qkv": "qkv_proj",
    "attn_output": "o_proj",
    "attn_q_norm": "q_norm",
    "attn_k_norm": "k_norm",
    "post_attention_norm": "attn_out_norm",
    "ffn_norm": "post_attention_layernorm",
    "post_ffw_norm": "mlp_out_norm",
    "ffn_gate": "gate_proj",
    "ffn_up": "up_proj",
    "ffn_down": "down_proj",
    "ffn_gate_inp": "router",
    "ffn_gate_inp_shexp": "shared_expert_gate",
    "attn_q_a": "q_a_proj", "attn_q_a_norm": "q_a_norm", "attn_q_b": "q_b_proj",  # latent attention's
    "attn_kv_a_mqa": "kv_a_proj", "attn_kv_a_norm": "kv_a_norm", "attn_kv_b": "kv_b_proj",
    "attn_k_b": "k_b_proj", "attn_v_b": "v_b_proj",
    "shortconv.in_proj": "conv_in_proj", "shortconv.conv": "conv_kernel", "shortconv.out_proj": "conv_out_proj",
    "attn_sinks": "sinks",  # a tensor, not a module's: named without the suffix
    "exp_probs_b": "selection_bias",  # the same
    # a Mamba-2 layer's (llama.cpp's mamba2 and granitehybrid files); A, D, dt's bias and the gated norm are tensors,
    # not modules' (A and D stored without a suffix, A as -exp(A_log): gguf_loader converts them back)
    "ssm_in": "mamba_in_proj", "ssm_conv1d": "mamba_conv", "ssm_out": "mamba_out_proj", "ssm_norm": "mamba_norm",
    "ssm_dt": "mamba_dt_bias", "ssm_a": "mamba_A_log", "ssm_d": "mamba_D",
}
# roles that name a tensor (not a module's weight or bias): the GGUF name's suffix is dropped
_TENSOR_ROLES = ("sinks", "selection_bias", "mamba_norm", "mamba_dt_bias", "mamba_A_log", "mamba_D", "delta_norm",
                 "delta_dt_bias", "delta_A_log", "layer_scalar", "router_input_scale", "expert_output_scale")
# every expert of a layer in one tensor [experts, rows, cols] -> the role of each expert's slice
_GGUF_EXPERT_ROLES = {"ffn_gate_exps": "expert_gate", "ffn_up_exps": "expert_up", "ffn_down_exps": "expert_down"}
# the converter's --fuse-gate-up-exps: each expert's gate rows, then its up rows, in one tensor
GGUF_FUSED_GATE_UP = "ffn_gate_up_exps"
# the shared expert's parts (roles), under the architecture's "shared_expert" prefix
_GGUF_SHARED_PARTS = {"ffn_gate_shexp": "shared_gate_proj", "ffn_up_shexp": "shared_up_proj",
                      "ffn_down_shexp": "shared_down_proj"}


def gguf_to_hf_name(name: str, arch: Architecture | None = None) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight`` (the name ``arch``'s
    checkpoints give it; Llama's by default); for stacked experts a name with ``{e}`` for the expert;
    None if not a tensor kvserve reads."""
    arch = arch or get_architecture("LlamaForCausalLM")
    stem, _, suffix = name.rpartition(".")
    if suffix not in ("weight", "bias"):  # a tensor stored without a suffix (a Mamba layer's ssm_a, ssm_d)
        stem, suffix = name, ""
    if stem in arch.gguf_globals:
        return f"{arch.gguf_globals[stem]}.{suffix}"
    if stem in _GGUF_GLOBAL_NAMES:
        return f"{_GGUF_GLOBAL_NAMES[stem]}.{suffix}"
    parts = stem.split(".", 2)  # a leaf may have a dot of its own ("shortconv.in_proj")
    if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    layer, leaf = f"model.layers.{parts[1]}.", parts[2]
    if leaf in _GGUF_EXPERT_ROLES:
        return f"{layer}{arch.weight_name('expert')}{arch.weight_name(_GGUF_EXPERT_ROLES[leaf])}.{suffix}"
    if leaf in _GGUF_SHARED_PARTS:
        return f"{layer}{arch.weight_name('shared_expert')}{arch.weight_name(_GGUF_SHARED_PARTS[leaf])}.{suffix}"
    role = arch.gguf_roles.get(leaf, _GGUF_LAYER_ROLES.get(leaf))
    if role == "mamba_dt_bias" and suffix != "bias":  # (a Mamba-2 file's ssm_dt is only its bias)
        return None
    if role in _TENSOR_ROLES:
        hf = arch.weight_name(role)
        return None if hf is None else f"{layer}{hf}"
    if not suffix:  # a module's weight named without ".weight" (gguf-py maps "pre_ff_layernorm.weight" whole)
        suffix = "weight"
    if role == "up_proj" and arch.weight_name("gate_up_proj") is not None:
        role = "gate_up_proj"  # llama.cpp names a stacked gate + up "ffn_up" (Phi-3): its graph splits it in halves
    if role is not None and role not in LLAMA_WEIGHTS:  # a tensor no role names: the checkpoint's own name
        return f"{layer}{role}.{suffix}"
    hf = None if role is None else arch.weight_name(role)
    return None if hf is None else f"{layer}{hf}.{suffix}"


def hf_to_gguf_name(name: str, arch: Architecture | None = None) -> str | None:
    """The name llama.cpp's converter gives a checkpoint tensor kept one per file entry (no stacked experts):
    the inverse of ``gguf_to_hf_name`` (``model.layers.3.self_attn.q_proj.weight`` -> ``blk.3.attn_q.weight``);
    None if no GGUF tensor maps to it."""
    arch = arch or get_architecture("LlamaForCausalLM")
    suffix = name.rpartition(".")[2]
    parts = name.split(".")
    if parts[:2] == ["model", "layers"] and len(parts) > 2 and parts[2].isdigit():
        stems = [f"blk.{parts[2]}.{leaf}" for leaf in (*arch.gguf_roles, *_GGUF_LAYER_ROLES, *_GGUF_SHARED_PARTS)]
    else:
        stems = [*arch.gguf_globals, *_GGUF_GLOBAL_NAMES]
    return next((f"{s}.{suffix}" for s in stems if gguf_to_hf_name(f"{s}.{suffix}", arch) == name), None)
