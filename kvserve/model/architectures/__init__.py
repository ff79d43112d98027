"""The model registry: each architecture a module here, registered by one line in ``_MODULES``.

An architecture is data, not code: what its ``config.json`` turns on in the shared decoder
(``ModelConfig``'s layer options: q/k norms, windows, soft caps, norms' layout, experts, ...) and how
its checkpoints name the weights (overrides of ``LLAMA_WEIGHTS``, for safetensors; llama.cpp's names
for GGUF follow from the same roles), and what its GGUF metadata stands for where llama.cpp leaves a
config.json key out. ``kvserve.model.decoder`` builds every one of them from the same
parts, and ``kvserve.model.weights`` reads the one table for the loaders, the checkpoint check and
the quantized layers' fusing. Torch-free: the simulator parses configs through it too.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


class GGUFGet(Protocol):
    """A GGUF file as an architecture's ``gguf_config`` reads it: ``get(key, default=None)`` its
    "<llama.cpp arch>.<key>" metadata, ``get.has(name)`` whether it holds a tensor, ``get.values(name)`` a small
    tensor's values (the per-pair rotary factors of ``rope_freqs``), ``get.shape(name)`` a tensor's shape (rows first)."""

    def __call__(self, key: str, default: Any = None) -> Any: ...

    def has(self, name: str) -> bool: ...

    def values(self, name: str) -> list[float]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...


# Our names for a layer's weights (roles) -> the names Llama's checkpoints give them, under
# "model.layers.{i}."; an architecture overrides what its checkpoints call otherwise (None: absent).
LLAMA_WEIGHTS: dict[str, str | None] = {
    "input_layernorm": "input_layernorm",  # before attention
    "post_attention_layernorm": "post_attention_layernorm",  # before the MLP
    "attn_out_norm": None,  # on attention's output (sandwich and post layouts)
    "mlp_out_norm": None,  # on the MLP's output (sandwich and post layouts)
    "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
    "qkv_proj": None,  # q, k and v already stacked in one tensor (Phi-3)
    "o_proj": "self_attn.o_proj",
    "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm",
    # latent attention (ModelConfig.kv_lora_rank): q's latent, its norm and its expansion (or q_proj alone), the
    # latent of k/v with the shared rotary key, its norm, and the per-head expansion of k's and v's parts
    "q_a_proj": "self_attn.q_a_proj", "q_a_norm": "self_attn.q_a_layernorm", "q_b_proj": "self_attn.q_b_proj",
    "kv_a_proj": "self_attn.kv_a_proj_with_mqa", "kv_a_norm": "self_attn.kv_a_layernorm",
    "kv_b_proj": "self_attn.kv_b_proj",
    "rope_key_norm": "self_attn.k_rope_only_layernorm",  # the norm on the shared rotary key (latent_rope_key_norm)
    # a lightning indexer (ModelConfig.index_topk): its q from q's latent, its k and the k's LayerNorm, its head weights
    "index_q": "self_attn.indexer.wq_b", "index_k": "self_attn.indexer.wk", "index_k_norm": "self_attn.indexer.k_norm",
    "index_weights": "self_attn.indexer.weights_proj",
    # kv_b_proj as GGUF files split it (per head: k's part transposed, v's): joined at load (weight_layout.join_latent_kv)
    "k_b_proj": "self_attn.k_b_proj", "v_b_proj": "self_attn.v_b_proj",
    # a short convolution (ModelConfig.conv_layers): its input and output projections, its depthwise kernel
    "conv_in_proj": "conv.in_proj", "conv_out_proj": "conv.out_proj", "conv_kernel": "conv.conv",
    # a Mamba-2 layer (ModelConfig.mamba_layers): its projections, depthwise convolution (weight and bias), dt's bias,
    # A's log, D (tensors, not modules) and the gated norm's weight
    "mamba_in_proj": "mamba.in_proj", "mamba_out_proj": "mamba.out_proj", "mamba_conv": "mamba.conv1d",
    "mamba_dt_bias": "mamba.dt_bias", "mamba_A_log": "mamba.A_log", "mamba_D": "mamba.D",
    "mamba_norm": "mamba.norm.weight", "mamba_x_proj": "mamba.x_proj", "mamba_dt_proj": "mamba.dt_proj",  # (Mamba-1's)
    "mamba_dt_norm": "mamba.dt_layernorm", "mamba_b_norm": "mamba.b_layernorm", "mamba_c_norm": "mamba.c_layernorm",
    # a gated delta net (ModelConfig.delta_layers): q/k/v, z, b and a apart (Qwen3.5's), or q/k/v/z and b/a stacked a key
    # head's group at a time (Qwen3-Next's: weight_layout.standard_layout reorders them); the convolution, dt's bias, A's log,
    # the gated norm's weight, out_proj
    "delta_qkv": "linear_attn.in_proj_qkv", "delta_z": "linear_attn.in_proj_z", "delta_b": "linear_attn.in_proj_b",
    "delta_a": "linear_attn.in_proj_a", "delta_qkvz": None, "delta_ba": None,
    "delta_in_proj": None,  # q/k/v, z, b and a stacked in that order in one tensor (Lara's)
    "delta_q": None, "delta_k": None, "delta_v": None,  # q, k and v apart (OLMo Hybrid), their convolutions too
    "delta_q_conv": None, "delta_k_conv": None, "delta_v_conv": None,
    "delta_conv": "linear_attn.conv1d",
    # Kimi delta attention's (ModelConfig.delta_rule "kimi"): the forget and output gates' low-rank projections
    "delta_f_a": None, "delta_f_b": None, "delta_g_a": None, "delta_g_b": None,
    "delta_dt_bias": "linear_attn.dt_bias", "delta_A_log": "linear_attn.A_log", "delta_norm": "linear_attn.norm.weight",
    "delta_out_proj": "linear_attn.out_proj",
    # Griffin's recurrent block (ModelConfig.lru_layers): x's and y's projections, the convolution, the RG-LRU (its
    # gates' tensors under it), out_proj
    "lru_x": None, "lru_y": None, "lru_conv": None, "lru": None, "lru_out": None,
    "rwkv_time": None, "rwkv_channel": None,  # RWKV's time and channel mixes (ModelConfig.rwkv_mix): their modules
    # an mLSTM layer (ModelConfig.mlstm): q, k, v, the output gate, the input and forget gates, the per-head norm, out
    "mlstm_q": None, "mlstm_k": None, "mlstm_v": None, "mlstm_ogate": None, "mlstm_igate": None, "mlstm_fgate": None,
    "mlstm_norm": None, "mlstm_out": None,
    # routed query attention (ModelConfig.attention_experts): tensors, not modules (full names)
    "attn_router": None, "attn_q_experts": None, "attn_o_experts": None, "attn_o_bias": None, "attn_kv_proj": None,
    "diff_lambda": "self_attn.lambda_",  # differential attention's lambda vectors (then q1, k1, q2, k2: tensors)
    "dt_proj": "self_attn.dt_proj", "dt_A": "self_attn.A",  # a key bias's projection and factors (Doge's)
    # the stream's per-channel weights before attention's add and the MLP's (Doge's: tensors)
    "attn_residual": "input_residual", "mlp_residual": "post_attention_residual",
    "sinks": "self_attn.sinks",  # one logit per head (a tensor, not a module: no .weight)
    # gated attention's output gate as a projection of its own (AFMoE's); None: its rows inside q_proj, each head's
    # after that head's q (Qwen3-Next's)
    "attn_gate_proj": None,
    "attn_q_scale": None,  # a tensor [heads x head_dim]: q's scale per channel after rotary (query_channel_scale)
    "attn_gate_bias": None,  # a tensor [heads] (not a module's): added to each head's gates (attn_output_gate_bias)
    # the norms on attention's output before o_proj and on the MLP's act(gate) * up before down
    # (ModelConfig.attn_sub_norm, mlp_sub_norm)
    "attn_sub_norm": "self_attn.attn_sub_norm", "mlp_sub_norm": "mlp.ffn_sub_norm",
    "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj", "down_proj": "mlp.down_proj",
    "gate_up_proj": None,  # gate and up already stacked (Phi-3)
    "act_fn": "mlp.act_fn",  # an activation with parameters of its own (xIELU: alpha_p, alpha_n, beta, eps)
    "router": "mlp.gate",
    "moe_out_bias": None,  # a tensor [hidden] (not a module's): the bias on the experts' sum
    "selection_bias": None,  # a tensor [1, experts] (not a module's): the bias that only chooses experts
    "moe_out_norm": None,  # the norm on an MoE block's output (ModelConfig.moe_out_norm)
    # tensors: the experts' output norms' weights [experts, hidden] and the shared expert's [hidden]
    # (ModelConfig.expert_out_norm); a residual gate's weights [hidden] of attention's add and the MLP's (residual_mix)
    "expert_out_norms": None, "shared_out_norm": None, "attn_residual_gate": None, "mlp_residual_gate": None,
    "expert": "mlp.experts.{e}.",  # then expert_gate / expert_up / expert_down
    "expert_gate": "gate_proj", "expert_up": "up_proj", "expert_down": "down_proj",
    "shared_expert": "mlp.shared_expert.",  # then shared_gate_proj / shared_up_proj / shared_down_proj
    "shared_gate_proj": "gate_proj", "shared_up_proj": "up_proj", "shared_down_proj": "down_proj",
    # the shared expert's gate and up already stacked (Granite MoE Shared); a GGUF file's apart are stacked at load
    "shared_gate_up_proj": None,
    "shared_expert_gate": "mlp.shared_expert_gate",
    # experts beside the dense MLP (ModelConfig.moe_beside_mlp): the norms on the MLP's output, the experts' input and
    # their output; a per-layer input's branch (its gate, its projection back, its norm); the layer's output scale
    "moe_mlp_out_norm": "post_feedforward_layernorm_1", "moe_in_norm": "pre_feedforward_layernorm_2",
    "experts_out_norm": "post_feedforward_layernorm_2", "per_layer_gate": "per_layer_input_gate",
    "per_layer_proj": "per_layer_projection", "per_layer_norm": "post_per_layer_input_norm",
    "layer_scalar": "layer_scalar",
    # tensors [hidden] and [experts] scaling the router's input and each expert's output, which the architecture's
    # adjust_weights folds into the router's and the experts' weights
    "router_input_scale": None, "expert_output_scale": None,
    # Gemma 3n's AltUp (its router, its coefficients) and LAuReL's branch: the module each layer's parts sit under
    "altup": "altup", "laurel": "laurel",
    # a shared transformer block (ModelConfig.shared_block_layers): its weights under its first user's layer (then the
    # roles above inside it), that layer's linear onto the mixer's input, and each use's adapters (a "{k}": the use;
    # then ".0" the down projection, ".1" the up one)
    "shared_block": None, "shared_block_proj": None, "shared_q_adapter": None, "shared_k_adapter": None,
    "shared_v_adapter": None, "shared_gate_up_adapter": None,
}


@dataclass(frozen=True)
class StackedExperts:
    """A layer's experts stored as two 3-D tensors, under "model.layers.{i}.": ``gate_up``
    [experts, hidden, 2 * inter] and ``down`` [experts, inter, hidden] (each expert's matrix transposed
    against a linear's weight, as gpt-oss stores them; not ``transposed``: [experts, 2 * inter, hidden]
    and [experts, hidden, inter], as Granite MoE does), their biases ``<name>_bias``; ``interleaved``:
    gate and up alternate instead of gate's half then up's. The loaders hand them on as stored;
    ``kvserve.model.weight_layout.unstack_experts`` cuts them into each expert's linears."""

    gate_up: str = "mlp.experts.gate_up_proj"
    down: str = "mlp.experts.down_proj"
    interleaved: bool = True
    transposed: bool = True
    # up's matrices in a tensor of their own (DBRX's ``v1``): ``gate_up`` then holds gate's alone
    up: str | None = None
    down_transposed: bool | None = None  # down's orientation where it differs from gate's and up's (DBRX's ``w2``)
    # each tensor 2-D, the experts' matrices one after another along its rows (DBRX's [experts * inter, hidden])
    flat: bool = False

    def orient(self, matrix: Any, down: bool = False) -> Any:
        """An expert's stored matrix as a linear's weight [out, in], or a linear's weight as stored (the same
        transpose both ways, where the layout is ``transposed``; ``down``'s by ``down_transposed`` where set)."""
        return matrix.t() if self._transposed(down) else matrix

    def stored_shape(self, experts: int, out: int, k: int, down: bool = False) -> tuple[int, ...]:
        """The stacked tensor's shape for ``experts`` linears of ``out`` x ``k`` (``down``: the down projections')."""
        shape = (experts, k, out) if self._transposed(down) else (experts, out, k)
        return (shape[0] * shape[1], shape[2]) if self.flat else shape

    def expert(self, tensor: Any, e: int, experts: int) -> Any:
        """Expert ``e``'s matrix (or bias) of a stacked tensor, as stored."""
        return tensor.reshape(experts, -1, tensor.shape[-1])[e] if self.flat else tensor[e]

    def _transposed(self, down: bool) -> bool:
        return self.down_transposed if down and self.down_transposed is not None else self.transposed


@dataclass(frozen=True)
class Architecture:
    """One registered architecture (``name``: the ``architectures`` entry of its config.json)."""

    name: str
    # config.json (its text part) -> the ModelConfig fields it sets beyond the common ones
    config: Callable[[dict[str, Any]], dict[str, Any]] = lambda d: {}
    weights: Mapping[str, str | None] = field(default_factory=dict)  # overrides of LLAMA_WEIGHTS
    gguf: str | None = None  # llama.cpp's general.architecture, where kvserve reads its GGUF files
    gguf_also: tuple[str, ...] = ()  # its other llama.cpp names (a MoE model's own: "nemotron_h_moe")
    # llama.cpp's converter reorders q/k rows (and biases) for GGML's rope on adjacent pairs (its
    # LlamaModel lineage: llama, granite, smollm3); the loader undoes it
    gguf_permuted: bool = False
    # GGUF metadata -> the config.json keys it implies beyond the common ones (``gguf_loader``): what
    # llama.cpp's graph assumes for this architecture; "architectures" may name another one the same
    # llama.cpp name covers (Mixtral is "llama" with experts)
    gguf_config: Callable[[GGUFGet], dict[str, Any]] = lambda get: {}
    # llama.cpp's names for a layer's tensors -> our roles, where its converter maps this architecture's
    # otherwise than the loader's table (gpt-oss: "post_attention_norm" is the norm before the MLP); or, for a tensor no
    # role names, its name under the checkpoint's layer (Gemma 3n's AltUp: "altup.modality_router")
    gguf_roles: Mapping[str, str] = field(default_factory=dict)
    # llama.cpp's names for tensors outside the layers -> ours, where its converter names this architecture's
    # otherwise (LFM2's final norm is "token_embd_norm")
    gguf_globals: Mapping[str, str] = field(default_factory=dict)
    # (ModelConfig, a GGUF file's tensors under our names) -> the layout the decoder takes, where this architecture's
    # converter changes more than the loader undoes for every one (Qwen3.5's value heads tiled)
    gguf_weights: Callable[[Any, dict[str, Any]], dict[str, Any]] | None = None
    # a multimodal config -> the text model's part (its layers, heads, ...)
    text_config: Callable[[dict[str, Any]], dict[str, Any]] = lambda d: d
    stacked_experts: StackedExperts | None = None  # experts in 3-D tensors; None: one set of linears each
    transposed_linears: bool = False  # linear weights stored [in, out] (GPT-2's Conv1D); the HF loader transposes them
    # a fused q/k/v tensor's rows head by head (GPT-NeoX's), or a KV head's group at a time (its queries, key, value:
    # Falcon's); the HF loader reorders them
    qkv_per_head: bool = False
    # (ModelConfig, the checkpoint's tensors) -> the tensors the decoder takes, at HF load: scales folded in (Falcon-H1)
    adjust_weights: Callable[[Any, dict[str, Any]], dict[str, Any]] | None = None
    # ModelConfig -> checkpoint tensors (name: shape) no parameter takes, which adjust_weights folds into others
    # (Dory's scales)
    folded_weights: Callable[[Any], dict[str, tuple[int, ...]]] | None = None
    # our layers a checkpoint layer holds (LongCat-Flash's two attentions and MLPs): our layer j is its layer
    # j // sublayers, "{s}" in a role's name the sub-layer j % sublayers (``weights.in_checkpoint_layer``)
    sublayers: int = 1
    # prefixes the checkpoint's names carry instead of ours ("model.", "lm_head."), e.g. a multimodal
    # checkpoint's "language_model.model."; the HF loader renames by them as it reads
    prefixes: Mapping[str, str] = field(default_factory=dict)
    # parts of a checkpoint's names replaced as read (after ``prefixes``), where one architecture names a weight two
    # ways by its config (Falcon's norms: "ln_attn" where the new decoder has two, else "input_layernorm")
    renames: Mapping[str, str] = field(default_factory=dict)

    def checkpoint_name(self, name: str, layers: Sequence[int] | None = None) -> str | None:
        """Our name for a checkpoint tensor ``name``: renamed by ``prefixes`` and ``renames``; None for a tensor
        outside the prefixes (a vision tower) where the architecture has any. ``layers``
        (``ModelConfig.checkpoint_layers``): the checkpoint's index of each of our layers; a layer not among them
        (one the decoder does not run) gives None."""
        if self.prefixes:
            found = next((ours + name[len(theirs):] for theirs, ours in self.prefixes.items()
                          if name.startswith(theirs)), None)
            if found is None:
                return None
            name = found
        for theirs, ours in self.renames.items():
            name = name.replace(theirs, ours)
        if layers is not None and name.startswith("model.layers."):
            index, _, rest = name[len("model.layers."):].partition(".")
            if not index.isdigit() or int(index) not in layers:
                return None
            name = f"model.layers.{list(layers).index(int(index))}.{rest}"
        return name

    def weight_name(self, role: str) -> str | None:
        return self.weights[role] if role in self.weights else LLAMA_WEIGHTS[role]


_ARCHITECTURES: dict[str, Architecture] = {}
# other names some released config.json files give a registered architecture (transformers' config renames them)
_ALIASES: dict[str, str] = {}


class UnsupportedArchitecture(ValueError):
    """A config.json naming an architecture that is not registered."""


def register(arch: Architecture, aliases: tuple[str, ...] = ()) -> Architecture:
    _ARCHITECTURES[arch.name] = arch
    _ALIASES.update(dict.fromkeys(aliases, arch.name))
    return arch


def get_architecture(name: str) -> Architecture:
    """The registered architecture (or the one ``name`` is another name of), or ``UnsupportedArchitecture`` naming the
    supported ones."""
    _load()
    name = _ALIASES.get(name, name)
    if name not in _ARCHITECTURES:
        raise UnsupportedArchitecture(f"architecture {name} is not supported (supported: {', '.join(architecture_names())})")
    return _ARCHITECTURES[name]


def generic_config(d: dict[str, Any]) -> dict[str, Any]:
    """Any config's shape as far as the common keys tell (experts under any of their usual names): what the
    simulator reads of an architecture kvserve does not serve."""
    experts = first_of(d, "num_experts", "num_local_experts", "n_routed_experts", default=0)
    if not experts:
        return {"sliding_window": d.get("sliding_window") or None}
    inter = first_of(d, "moe_intermediate_size", "intermediate_size", default=0)
    shared = first_of(d, "shared_expert_intermediate_size", default=(d.get("n_shared_experts") or 0) * inter)
    return {"num_experts": experts, "num_experts_per_tok": d.get("num_experts_per_tok") or 1,
            "moe_intermediate_size": inter, "shared_expert_intermediate_size": shared,
            "sliding_window": d.get("sliding_window") or None}


GENERIC = Architecture("generic", generic_config)


def partial_rotary(d: dict[str, Any], default: float) -> float:
    """The share of each head's dims that rotate: ``partial_rotary_factor`` at the top level (transformers 4) or in
    ``rope_parameters`` (5), else the architecture's ``default``."""
    params = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), dict) else {}
    return float(first_of(d, "partial_rotary_factor", default=params.get("partial_rotary_factor", default)))


def gguf_rotary_share(get: GGUFGet) -> dict[str, Any]:
    """HF's ``partial_rotary_factor`` from llama.cpp's rotating dims (``rope.dimension_count``) per head."""
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    rotary = get("rope.dimension_count")
    return {"partial_rotary_factor": rotary / int(get("attention.key_length") or hidden // heads) if rotary else 1.0}


def architecture_names() -> list[str]:
    _load()
    return sorted(_ARCHITECTURES)


def gguf_architectures() -> dict[str, str]:
    """llama.cpp's architecture name -> ours, for the GGUF loader."""
    _load()
    return {g: a.name for a in _ARCHITECTURES.values() for g in ((a.gguf, *a.gguf_also) if a.gguf else ())}


# one line per architecture module
_MODULES = ["llama", "qwen2", "qwen3", "qwen_moe", "mistral", "mixtral", "gemma", "gemma2", "gemma3", "phi3",
            "olmo2", "olmoe", "granite", "granite_moe", "gpt_oss", "gemma3_mm", "smollm3", "starcoder2", "glm4",
            "ernie4_5", "stablelm", "cohere", "cohere2", "exaone4", "olmo3", "mistral3", "helium", "seed_oss",
            "arcee", "ernie4_5_moe", "phi", "glm4_moe", "hunyuan_dense", "deepseek_v2", "deepseek_v3",
            "glm4_moe_lite", "lfm2", "lfm2_moe", "qwen_vl", "dots1", "nemotron", "hunyuan_moe",
            "minimax_m2", "gpt2", "opt", "gpt_neox", "flex_olmo", "vaultgemma", "cwm", "olmo", "apertus",
            "apertus1p5", "phimoe", "bamba", "qwen3_next", "qwen3_5", "nemotron_h",
            "mamba2", "falcon_h1", "bloom", "mpt", "llama4", "jamba", "gemma4", "olmo_hybrid", "solar_open", "cohere2_moe",
            "afmoe", "laguna", "mellum", "flint", "hy_v3", "granite_swa", "hyperclovax", "jais2", "nanochat", "persimmon",
            "falcon", "dbrx", "bitnet", "axk1", "youtu", "minicpm5_moe", "minicpm3", "exaone_moe", "kolibri1",
            "deepseek_v32", "glm_moe_dsa", "longcat_flash", "gemma3n", "gemma4_unified", "mllama", "aria", "gpt_neo",
            "codegen", "xglm", "openai_gpt", "jetmoe", "zamba2", "zamba", "lfm3", "mimo_v2_flash",
            "recurrent_gemma", "rwkv", "xlstm", "diffllama", "doge", "emu3", "biogpt", "gpt_neox_japanese", "ctrl",
            "modernbert_decoder", "lara_mini", "dots3_note", "kimi_linear", "minimax",
            "bailing_hybrid", "beam", "ergo", "axk2", "hrm_text", "dory",
            "kolibri1_1"]


_loaded: list[bool] = []  # (a flag, not the table's emptiness: importing one module first registers it alone)


def _load() -> None:
    if not _loaded:
        for module in _MODULES:
            importlib.import_module(f"{__name__}.{module}")
        _loaded.append(True)


def first_of(d: dict[str, Any], *keys: str, default: Any = None) -> Any:
    """The first of ``keys`` that ``d`` sets (not None)."""
    return next((d[k] for k in keys if d.get(k) is not None), default)
