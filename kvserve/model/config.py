"""ModelConfig: the shape of a decoder and the options of its layers, whatever file it came from.

One parse of a Hugging Face ``config.json`` (``from_hf_dict``): the fields every decoder has are read
here, and the architecture's own entry (``kvserve.model.architectures``) adds its options (q/k norms,
windows, soft caps, MoE, ...). The loaders, the runner and the simulator all read this one result.
Torch-free, so that the simulator can use it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# (FULL, SLIDING: the layer types' names; NORM_ROLES: a sandwich layer's norms; rope_settings, yarn_mscale: their users
# import them from here)
from kvserve.model.layer_plan import FULL, NORM_ROLES, SLIDING, LayerPlan, MLSTMShape, roles_of_layout  # noqa: F401
from kvserve.model.mixer_options import MixerOptions
from kvserve.model.rope_config import rope_settings, yarn_mscale  # noqa: F401

# the gated MLPs' activations with a fused native kernel (kernel's name), which the native decode stack runs
NATIVE_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}


@dataclass
class ModelConfig(LayerPlan, MixerOptions):
    """Architecture hyper-parameters, named as in a Hugging Face ``config.json`` where it has a name (the token mixers'
    other than attention: ``MixerOptions``)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # HF's rope_scaling dict, e.g. {"rope_type": "llama3", "factor": 8.0, ...}; None for plain RoPE
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    architecture: str = "LlamaForCausalLM"

    # --- layer options (the defaults are Llama's) ---
    o_proj_bias: bool = False  # Llama's attention_bias covers o_proj too; Qwen2's does not
    mlp_bias: bool = False
    hidden_act: str = "silu"  # the gated MLP's activation: silu or gelu_pytorch_tanh
    # q/k RMSNorm after the projections: "head" over each head's dims (Qwen3, Gemma 3), "full" over the
    # whole projection (OLMo 2), None: none
    qk_norm: str | None = None
    qk_norm_after_rope: bool = False  # the per-head q/k norms on the rotated q and k (Hunyuan), not before rotary
    # per-head q/k norms that are LayerNorms ("layer": Cohere's use_qk_norm, StableLM's and Phi's qk_layernorm), with
    # a weight for each head ([heads, head_dim]: Cohere, StableLM) or one they share, and with a bias (Phi)
    qk_norm_type: str = "rms"  # (or "unweighted": an RMSNorm without a weight, Llama 4's)
    qk_norm_per_head: bool = False
    qk_norm_bias: bool = False
    qk_norm_layers: list[bool] | None = None  # the layers with q/k norms (Llama 4: its rotary ones); None: all
    # where the norms sit: "pre" (Llama), "sandwich" (Gemma 2/3: also on each sublayer's output),
    # "post" (OLMo 2: only on each sublayer's output), "parallel" (StableLM's use_parallel_residual: one norm,
    # attention and the MLP both read it and both outputs join the residual), "parallel_two" (GPT-NeoX's: the same
    # with a norm of its own for the MLP), "post_add" (the original Transformer's, GPT-1's: the stream itself normed
    # after each sublayer's add), "normed_residual" (MiniMax's: each norm's output is the residual its sublayer adds to,
    # both scaled by sublayer_scales)
    norm_layout: str = "pre"
    # per layer, the normed_residual layout's (residual, attention's output, residual, the MLP's output) multipliers
    sublayer_scales: list[tuple[float, float, float, float]] | None = None
    final_norm: bool = True  # a norm after the last layer (GPT-1 has none)
    norm_gate_rank: int = 0  # input norms (and MoE layers' MLP norms) gated by sigmoid(low-rank MLP of their output)
    norm_offset: float = 0.0  # Gemma's norms scale by (1 + weight)
    norm_type: str = "rms"  # the layers' and the final norm: "rms" or "layer" (LayerNorm: Starcoder2)
    norm_bias: bool = True  # a "layer" norm has a bias (Cohere's have none)
    norm_affine: bool = True  # False: norms with neither weight nor bias (OLMo 1's LayerNorms, NanoChat's RMSNorms)
    gated_mlp: bool = True  # False: the MLPs (and experts) are down(act(up(x))) (Starcoder2, Nemotron-H)
    attn_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    attn_logit_softcap: float | None = None  # Gemma 2: cap * tanh(scores / cap)
    # queries scaled by 1 + beta * log(1 + floor(position / length)) after rotary (Ministral 3's llama_4_scaling_beta,
    # length its original context): (beta, length), None: unscaled
    query_position_scale: tuple[float, int] | None = None
    # Llama 4's attention temperature: the same with position + 1, on the layers without rotary (Ministral 3: with it)
    query_scale_offset: int = 0
    query_scale_nope: bool = False
    query_scale_power: bool = False  # the scale exp(beta * log1p((position + offset) / length)) instead (Beam's)
    query_channel_scale: bool = False  # q times a learned scale per channel after rotary (Dory's, squared at load)
    # Llama 4's chunked attention: the layers layer_types names "chunked_attention" attend within their chunk of
    # attention_chunk tokens (key and query in the same chunk)
    attention_chunk: int | None = None
    # Llama 4's experts: each scales its input by the router's weight (rather than its output)
    moe_scale_inputs: bool = False
    final_logit_softcap: float | None = None
    logit_scale: float = 1.0  # logits multiplied by this (Granite: 1 / logits_scaling)
    lm_head_bias: bool = False  # the LM head has a bias (Phi-2); untied only
    output_vocab_size: int = 0  # an LM head pruned to the first ids (Apertus 1.5; the rest -inf); 0: vocab_size
    # a learned table of absolute positions added to the token embeddings (GPT-2, OPT: position + position_offset),
    # and no rotary
    learned_positions: bool = False
    position_offset: int = 0
    embed_scale: float = 1.0  # embeddings multiplied by this (Gemma: sqrt(hidden), Granite: embedding_multiplier)
    residual_scale: float = 1.0  # each sublayer's output multiplied by this before the add (Granite)
    residual_mix: str | None = None  # sandwich adds as a*out + b*stream: "depth" (Beam), "gated" (Ergo), "interpolate"
    sliding_window: int | None = None  # keys a sliding layer attends: the query's own and the window - 1 before
    layer_types: list[str] | None = None  # per layer FULL or SLIDING; None: every layer FULL (or all SLIDING with a window)
    rope_local_theta: float | None = None  # sliding layers' own RoPE base, unscaled (Gemma 3)
    rope_local_partial_rotary_factor: float | None = None  # the sliding layers' own share of rotating dims (Laguna)
    rope_local_layers: list[bool] | None = None  # the layers rotating by rope_local_theta (GraniteSWA); None: sliding
    rope_local_scaled: bool = False  # the local base scaled as the global one is (GraniteSWA's share rope_parameters)
    partial_rotary_factor: float = 1.0  # the share of each head's dims that rotate (Phi-4-mini)
    # rotary on pairs of adjacent dims (2i, 2i+1; GLM-4) instead of halves (i, i + dim/2): q's and k's rows are
    # reordered at load (``weight_layout.deinterleave_rotary``), so that every rotary path takes it as it is
    rope_interleaved: bool = False
    rope_layers: list[bool] | None = None  # per layer: whether q/k rotate; None: every layer (SmolLM3 skips some)
    attn_sinks: bool = False  # a learned logit per head in each softmax's denominator (gpt-oss)
    sink_layers: list[bool] | None = None  # the layers with sinks where attn_sinks (MiMo-V2-Flash's windowed): all
    clip_qkv: float | None = None  # q, k and v clamped to +-this after their projections (and norms) (OLMoE)
    # the gated MLPs' SwiGLU clamped as gpt-oss's: g = min(gate, limit),
    # (clamp(up, +-limit) + 1) * g * sigmoid(alpha * g); None: hidden_act's plain gated MLP
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.0
    # per layer, the experts' and the shared expert's SwiGLU clip (GatedMLP.clip: Ling 3's late layers; 0: none)
    expert_clip_layers: list[float] | None = None
    shared_expert_clip_layers: list[float] | None = None
    # --- mixture of experts ---
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the chosen experts' weights to sum to 1
    moe_layers: list[bool] | None = None  # per layer: MoE or the dense MLP; None: every layer MoE when num_experts
    shared_expert_intermediate_size: int = 0  # a dense expert every token takes (Qwen2-MoE, Granite MoE Shared)
    shared_expert_gated: bool = True  # weighted by sigmoid(gate . x) (Qwen2-MoE); False: added as is (Granite)
    router_bias: bool = False  # the router's linear has a bias (gpt-oss)
    moe_out_bias: bool = False  # a bias added to the experts' weighted sum (JetMoE's)
    # a bias [1, experts] added to the router's probabilities to choose the experts, not to weight them (ERNIE 4.5
    # MoE's e_score_correction_bias)
    selection_bias: bool = False
    # "sigmoid": each expert scored by sigmoid(logit) on its own (GLM-4.5 MoE); "sparsemixer": Phi-3.5-MoE's two
    # picks, each weighted by a softmax over the logits near it (within 2 x router_jitter, relatively)
    router_scoring: str = "softmax"
    router_jitter: float = 0.01
    router_logit_softcap: float | None = None  # the router's logits as cap * tanh(logits / cap) before scoring (Laguna)
    routed_scale: float = 1.0  # the routed experts' weights multiplied by this (routed_scaling_factor)
    expert_bias: bool = False  # each expert's linears have biases (gpt-oss)
    # expert groups (DeepSeek): a row's experts come from its best ``expert_groups_used`` of ``expert_groups`` equal
    # groups, each ranked by its best choosing score ("max") or the sum of its best two ("top2")
    expert_groups: int = 1
    expert_groups_used: int = 1
    group_scoring: str = "max"
    selection_on_logits: bool = False  # the selection bias added to the router's logits, not its scores (Kolibri)
    moe_out_norm: bool = False  # an RMSNorm on the MoE layers' output, shared experts included (A.X-K1)
    expert_out_norm: bool = False  # each expert's output RMS-normed by a weight of its own, the shared one's too (Ergo)
    # LongCat-Flash: the even layers' experts beside their MLP, added after the next one's; identity experts return x
    moe_shortcut: bool = False
    identity_experts: int = 0
    # --- multi-head latent attention (DeepSeek-V2/V3): k and v expanded per head from a latent of kv_lora_rank
    # (normed) beside one rotary key of qk_rope_head_dim every head shares; q from its own latent of q_lora_rank
    # (0: q's own projection). The cache holds the expanded heads, num_key_value_heads = num_attention_heads, of
    # head_dim max(qk_nope_head_dim + qk_rope_head_dim, v_head_dim) (the shorter of k and v zero-padded) ---
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    # per layer (q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim) where layers differ (Dots 3's
    # sliding layers; their heads and cache shapes: attention_heads_per_layer, layer_head_dims, layer_kv_heads)
    latent_layer_dims: list[tuple[int, int, int, int, int]] | None = None
    latent_rope_key_norm: bool = False  # an RMSNorm on the shared rotary key before rotary (Dots 3)
    latent_q_gate: bool = False  # q_b reads [normed, raw] q latent, giving each head's q then a sigmoid gate (A.X-K2)
    # --- a lightning indexer (DeepSeek-V3.2's sparse attention; 0: none): each query attends its index_topk keys of the
    # best sum over index_heads of weight * relu(q . k) (index_head_dim, the first qk_rope_head_dim rotated, as pairs where
    # index_rope_interleaved), its keys in a pool layer of their own; index_layers: those running one (the rest reuse) ---
    index_topk: int = 0
    index_heads: int = 0
    index_head_dim: int = 0
    index_rope_interleaved: bool = False
    index_layers: list[bool] | None = None
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    # (without latent attention: values of v_head_dim narrower than head_dim, zero-padded in the cache and cut from
    # attention's output: MiMo-V2-Flash's; 0: head_dim)
    v_head_dim: int = 0
    # Falcon-H1: each Mamba-2 layer attends too, side by side over the same norm, the two outputs summed
    parallel_attention: bool = False
    # scales an architecture folds into its weights at load (Architecture.adjust_weights: Falcon-H1's muP multipliers)
    weight_multipliers: dict[str, Any] | None = None
    # --- ALiBi (Bloom, MPT): no rotary; each head's scores biased by its slope times the key's distance
    # (attention.alibi_slopes) ---
    alibi: bool = False
    alibi_bias_max: float = 8.0
    alibi_mpt: bool = False  # MPT's slopes where the heads are not a power of two
    alibi_scale: float = 1.0  # the slopes multiplied by this (Falcon's biases are divided by sqrt(head_dim))
    embed_norm: bool = False  # a norm (of norm_type) right after the embeddings (Bloom's word_embeddings_layernorm)
    # gated attention (Qwen3-Next): q_proj also gives a gate per head's dim, and sigmoid(gate) scales attention's output
    attn_output_gate: bool = False
    attn_output_gate_fn: str = "sigmoid"  # the gate's function: "sigmoid", or "softplus" (Laguna's)
    attn_output_gate_per_head: bool = False  # one gate a head, over all its dims (Laguna's), not one a value
    attn_output_gate_bias: bool = False  # a bias a head added to its gates (Beam's gate_bias)
    attention_heads_per_layer: list[int] | None = None  # query heads by layer (Laguna's; the KV heads: every layer's)
    attn_sub_norm: bool = False  # an RMSNorm over attention's output before o_proj (BitNet's attn_sub_norm)
    mlp_sub_norm: bool = False  # one over the dense MLP's act(gate) * up before down (BitNet's ffn_sub_norm)
    # --- layers of one sublayer (Nemotron-H's blocks, Mamba2's): per layer "mixer" (its token mixer alone), "mlp" (its
    # MLP or experts alone) or "both"; None: every layer has both. Pre-norm layout only ---
    layer_parts: list[str] | None = None
    # --- Gemma 4's layers. Attention shapes per layer (its global layers: wider heads, fewer K/V heads), None: head_dim
    # and num_key_value_heads everywhere; values RMS-normed per head without a weight; layers whose values are their
    # keys' projection (no v_proj); layers that attend over an earlier layer's K/V (kv_shared_from: that layer, or
    # itself), projecting only q ---
    layer_head_dims: list[int] | None = None
    layer_kv_heads: list[int] | None = None
    v_norm: bool = False
    kv_nvfp4: bool = False  # the full layers' K and V rounded to NVFP4's values (Kolibri 1.1's sparse layers)
    k_eq_v_layers: list[bool] | None = None
    kv_shared_from: list[int] | None = None
    # mixture of attention heads (JetMoE): q and o projections routed among this many experts, num_experts_per_tok a
    # token, each giving a query head per K/V head (kvserve.model.routed_attention); 0: plain attention
    attention_experts: int = 0
    diff_attention: bool = False  # differential attention (DiffLlama's: kvserve.model.diff_attention)
    key_bias: bool = False  # a bias per key and K/V head from its values (Doge's dynamic mask: model.dynamic_mask)
    residual_weights: bool = False  # the stream multiplied per channel before each sublayer's add (Doge's)
    first_input_norm: bool = True  # False: the first layer attends its input unnormed (ModernBERT's decoder)
    # ModernBERT's prediction head after the final LayerNorm (model.prediction_head): a dense layer (with a bias where
    # head_transform_bias) under this activation, then a LayerNorm; None: none
    head_transform: str | None = None
    head_transform_bias: bool = False
    layer_intermediate_sizes: list[int] | None = None  # per layer, the dense MLP's width; None: intermediate_size
    # the checkpoint's index of each layer, where it holds layers the decoder does not run (Mllama's cross-attention
    # layers, which a text prompt skips): the HF loader reads the others as ours 0, 1, ...; None: the same indices
    checkpoint_layers: list[int] | None = None
    # per-layer inputs: a table of per_layer_input_size values per layer for each token (of per_layer_vocab_size ids),
    # mixed with a projection of the embeddings; each layer ends with a gated residual branch that reads its own
    per_layer_input_size: int = 0
    per_layer_vocab_size: int = 0
    layer_scalars: bool = False  # each layer's output multiplied by a learned scalar
    # experts beside the dense MLP, each branch normed on its own; the router reads the residual stream RMS-normed
    # (without a weight: the router's scales are folded into it at load)
    moe_beside_mlp: bool = False
    # the recurrent layers' norm layout where it is not norm_layout (OLMo Hybrid: pre-norm delta nets among post-norm
    # attention layers)
    recurrent_norm_layout: str | None = None
    delta_beta_scale: float = 1.0  # the delta rule's write strength times this (OLMo Hybrid's 2: negative eigenvalues)
    delta_norm_eps: float | None = None  # the delta nets' gated norm's epsilon; None: rms_norm_eps
    # --- Gemma 3n's layers (kvserve.model.altup): altup_streams residual streams, each layer running on the active one
    # and correcting them all; a low-rank branch beside attention (LAuReL) of laurel_rank; per layer, the share of the
    # MLP gate's values cut to 0 (activation sparsity), None: none ---
    altup_streams: int = 0
    altup_active: int = 0
    altup_correct_scale: bool = True
    laurel_rank: int = 0
    activation_sparsity: list[float] | None = None
    mamba_norm_eps: float | None = None  # the Mamba-2 gated norm's epsilon where it is not rms_norm_eps (Zamba2's)
    # --- transformer blocks shared between layers (Zamba; kvserve.model.shared_block): before the mixer of each layer
    # shared_block_layers names, one of shared_blocks blocks in turn reads [stream, embeddings] (attention over twice
    # the hidden size, then its MLP, each after a norm, no residual); the layer's own linear adds the result to the
    # mixer's input. Low-rank adapters of shared_block_adapter_rank per use (0: none) on the MLP's gate/up and, where
    # shared_block_qkv_adapters, on q, k and v ---
    shared_block_layers: list[bool] | None = None
    shared_blocks: int = 1
    shared_block_adapter_rank: int = 0
    shared_block_qkv_adapters: bool = False
    stack_cycles: tuple[int, int, int] | None = None  # HRM's (layers a stack, high, low cycles): kvserve.model.cycles
    recurrent_loops: tuple[int, int, int] | None = None  # Dory's (input layers, looped layers, loops): model.cycles

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        for name in ("layer_types", "rope_layers", "rope_local_layers", "moe_layers", "conv_layers", "mamba_layers",
                     "delta_layers", "lru_layers", "rwkv_mix", "layer_parts", "qk_norm_layers", "layer_head_dims", "layer_kv_heads",
                     "k_eq_v_layers", "kv_shared_from", "layer_intermediate_sizes", "attention_heads_per_layer",
                     "index_layers", "activation_sparsity", "checkpoint_layers", "shared_block_layers", "sink_layers",
                     "latent_layer_dims", "sublayer_scales", "expert_clip_layers", "shared_expert_clip_layers"):
            per_layer = getattr(self, name)
            if per_layer is not None and len(per_layer) != self.num_hidden_layers:
                raise ValueError(f"{name} has {len(per_layer)} entries for {self.num_hidden_layers} layers")
        if any(self.attention_heads(i) % self.attn_kv_heads(i) for i in range(self.num_hidden_layers)):
            raise ValueError("num_attention_heads (every layer's) must be a multiple of num_key_value_heads")
        if self.attention_experts and self.num_attention_heads != self.num_key_value_heads * self.num_experts_per_tok:
            raise ValueError("routed query experts give num_key_value_heads x num_experts_per_tok query heads")
        if not self.mamba_inner:
            self.mamba_inner = self.mamba_heads * self.mamba_head_dim
        if self.delta_rule not in ("gated", "kimi", "lightning"):
            raise ValueError(f"delta_rule {self.delta_rule!r} is not one of gated, kimi, lightning")
        if self.mamba_norm not in ("gated", "norm_then_gate", "none"):
            raise ValueError(f"mamba_norm {self.mamba_norm!r} is not one of gated, norm_then_gate, none")
        if self.layer_parts is not None and (set(self.layer_parts) - {"mixer", "mlp", "both"} or self.norm_layout != "pre"):
            raise ValueError("layer_parts are 'mixer', 'mlp' or 'both', in the pre-norm layout")
        if self.mlp_sub_norm and (self.num_experts or not self.gated_mlp or self.swiglu_limit is not None):
            raise ValueError("mlp_sub_norm is a dense gated MLP's (no experts, no clamped SwiGLU)")
        if (self.laurel_rank and self.altup_streams < 2) or (self.altup_streams > 1 and self.norm_layout != "sandwich"):
            raise ValueError("LAuReL's branch is AltUp's layer's (altup_streams 2 or more), in the sandwich layout")
        if any(self.activation_sparsity or ()) and not self.gated_mlp:
            raise ValueError("activation sparsity cuts a gated MLP's gate")
        if self.lm_head_bias and self.tie_word_embeddings:
            raise ValueError("an LM head with a bias must be its own weight (tie_word_embeddings false)")
        if (self.qk_norm_after_rope or self.qk_norm_type != "rms") and self.qk_norm != "head":
            raise ValueError("q/k norms after rotary, and q/k LayerNorms, are per head (qk_norm 'head')")
        if self.router_scoring not in ("softmax", "sigmoid", "sparsemixer"):
            raise ValueError(f"router scoring {self.router_scoring!r} is not supported (softmax, sigmoid, sparsemixer)")
        if self.router_scoring == "sparsemixer" and self.num_experts_per_tok != 2:
            raise ValueError("the sparsemixer router picks 2 experts a token (num_experts_per_tok 2)")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be 1..{self.num_experts}")
        if self.expert_groups_used < self.expert_groups:
            self._check_expert_groups()
        if self.partial_rotary_factor < 1 and self.rotary_dim % 2:  # (transformers' tables then cover one dim more)
            raise ValueError(f"an odd number of rotary dims ({self.rotary_dim}: head_dim x partial_rotary_factor) is "
                             "not supported")
        if self.mlp_bias and self.num_experts and self.shared_expert_intermediate_size:
            # transformers' shared experts take mlp_bias too; ours are unbiased (their biases would go unread)
            raise ValueError("mlp_bias on an MoE block's shared experts is not supported")
        widest = max(self.attn_head_dim(i) for i in range(self.num_hidden_layers))
        if not self.kv_lora_rank and self.v_head_dim > widest:
            raise ValueError("values wider than keys (v_head_dim > head_dim) are cached only with latent attention")
        if self.kv_lora_rank and (self.num_key_value_heads != self.num_attention_heads or
                                  self.head_dim != max(self.qk_nope_head_dim + self.qk_rope_head_dim, self.v_head_dim)):
            raise ValueError("latent attention caches every head (num_key_value_heads = num_attention_heads) at "
                             "head_dim max(qk_nope_head_dim + qk_rope_head_dim, v_head_dim)")
        if self.index_topk:
            self._check_indexer()

    def _check_indexer(self) -> None:
        if not (self.kv_lora_rank and self.q_lora_rank) or (self.index_layers or [True])[0] is False:
            raise ValueError("a lightning indexer needs a q latent (q_lora_rank) and the first layer to run one")
        if not self.qk_rope_head_dim <= self.index_head_dim <= self.num_key_value_heads * int(self.head_dim or 0):
            raise ValueError(f"index_head_dim {self.index_head_dim}: not within the rotary dims and a pool layer's K")

    def _check_expert_groups(self) -> None:
        groups, used, experts = self.expert_groups, self.expert_groups_used, self.num_experts
        if not experts or experts % groups or used < 1:
            raise ValueError(f"{experts} experts do not split into {groups} expert groups of which {used} are used")
        if self.group_scoring not in ("max", "top2", "top2_zero") or \
                (self.group_scoring != "max" and experts // groups < 2):  # (top2_zero: A.X-K2's, others at 0)
            raise ValueError(f"group scoring {self.group_scoring!r} is not supported (max; top2, top2_zero: 2+ each)")
        if self.num_experts_per_tok > used * (experts // groups):
            raise ValueError(f"{self.num_experts_per_tok} experts a token cannot come from {used} groups of "
                             f"{experts // groups}")

    @property
    def expert_group_choice(self) -> tuple[int, int, str] | None:
        """(groups, groups used, group scoring) where groups restrict a row's experts; None where any expert may be
        chosen."""
        if self.expert_groups_used >= self.expert_groups:
            return None
        return self.expert_groups, self.expert_groups_used, self.group_scoring

    @property
    def swiglu(self) -> tuple[float, float | None] | None:
        """(alpha, limit) of the gated MLPs' clamped SwiGLU (``mlp.clamped_swiglu``); None: ``hidden_act``'s."""
        return None if self.swiglu_limit is None else (self.swiglu_alpha, self.swiglu_limit)

    def attention_params(self) -> int:
        """Weights in one layer's attention projections (biases and norms aside)."""
        h, heads, d = self.hidden_size, self.num_attention_heads, int(self.head_dim or 0)
        if not self.kv_lora_rank:
            return 2 * h * heads * d + 2 * h * self.num_key_value_heads * d
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        q = self.q_lora_rank * (h + heads * qk) if self.q_lora_rank else h * heads * qk
        kv = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank * heads * (self.qk_nope_head_dim
                                                                                           + self.v_head_dim)
        return q + kv + heads * self.v_head_dim * h

    @property
    def rotary_dim(self) -> int:
        if self.kv_lora_rank:  # latent attention: the rotary key's dims
            return self.qk_rope_head_dim
        return int(int(self.head_dim or 0) * self.partial_rotary_factor)

    @property
    def norm_roles(self) -> tuple[str, ...]:
        """The norms each layer has (``LLAMA_WEIGHTS`` roles), by ``norm_layout``."""
        return roles_of_layout(self.norm_layout)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], strict: bool = True) -> "ModelConfig":
        """Build from a parsed Hugging Face config.json: the common fields, then the architecture's own
        (``kvserve.model.architectures``); raises ``UnsupportedArchitecture`` (a ``ValueError``) for an
        architecture not registered.
        Not ``strict`` (the simulator's shapes): an unregistered or unnamed architecture is read by its
        common keys (``generic_config``)."""
        from kvserve.model.architectures import GENERIC, architecture_names, get_architecture

        named = (d.get("architectures") or [None])[0]
        arch = named or "LlamaForCausalLM"
        spec = get_architecture(arch) if strict or (named in architecture_names()) else GENERIC
        d = spec.text_config(d)
        eos = d.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        rope_theta, rope_scaling = rope_settings(d)
        common: dict[str, Any] = dict(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d.get("intermediate_size") or 0,
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
            head_dim=d.get("head_dim"),
            rms_norm_eps=d.get("rms_norm_eps", 1e-5),
            rope_theta=rope_theta or 10000.0,
            rope_scaling=rope_scaling,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            attention_bias=bool(d.get("attention_bias", False)),
            o_proj_bias=bool(d.get("attention_bias", False)),
            mlp_bias=bool(d.get("mlp_bias", False)),
            hidden_act=d.get("hidden_act") or d.get("hidden_activation") or "silu",
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            architecture=arch,
        )
        common.update(spec.config(d))
        return cls(**common)
