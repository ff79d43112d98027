"""LayerPlan: what each layer of a ``ModelConfig`` is (its token mixer, its window, its share of the KV pool, its
attention's shape), asked of the config's per-layer fields. Torch-free, as the config is."""

from __future__ import annotations

from dataclasses import dataclass

FULL, SLIDING = "full_attention", "sliding_attention"  # HF's layer_types values
# a layer's norms in the sandwich layout: every one (the other layouts have some of them: roles_of_layout)
NORM_ROLES = ("input_layernorm", "post_attention_layernorm", "attn_out_norm", "mlp_out_norm")


def roles_of_layout(layout: str) -> tuple[str, ...]:
    """The norms (``LLAMA_WEIGHTS`` roles) a layer of ``layout`` has."""
    return {"pre": ("input_layernorm", "post_attention_layernorm"), "post": ("attn_out_norm", "mlp_out_norm"),
            "post_add": ("attn_out_norm", "mlp_out_norm"),
            "normed_residual": ("input_layernorm", "post_attention_layernorm"),
            "parallel": ("input_layernorm",),
            "parallel_two": ("input_layernorm", "post_attention_layernorm")}.get(layout, NORM_ROLES)


@dataclass(frozen=True)
class MLSTMShape:
    """An xLSTM model's mLSTM layers (``kvserve.model.mlstm``): heads, the q/k and v widths (all heads), the input and
    forget gates' soft cap (None: none), the normalizer's eps, the per-head output LayerNorm's eps."""

    heads: int
    qk_dim: int
    v_dim: int
    gate_cap: float | None
    eps: float
    norm_eps: float


class LayerPlan:
    """Per-layer questions, answered from ``ModelConfig``'s fields (the dataclass inherits them)."""

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer``, or None where it attends the whole context."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[layer] == SLIDING:
            return self.sliding_window
        return None

    def chunk(self, layer: int) -> int | None:
        """The chunk ``layer`` attends within (Llama 4's chunked attention), or None."""
        if self.attention_chunk is None or self.layer_types is None or self.layer_types[layer] != "chunked_attention":
            return None
        return self.attention_chunk

    def attention_heads(self, layer: int) -> int:
        return self.num_attention_heads if self.attention_heads_per_layer is None else self.attention_heads_per_layer[layer]

    def has_sinks(self, layer: int) -> bool:
        return self.attn_sinks and (self.sink_layers is None or self.sink_layers[layer])

    def value_dim(self, layer: int) -> int:
        """The width of ``layer``'s value heads (attention without latents: ``v_head_dim`` where set)."""
        return self.v_head_dim if self.v_head_dim and not self.kv_lora_rank else self.attn_head_dim(layer)

    def has_qk_norm(self, layer: int) -> bool:
        return self.qk_norm is not None and (self.qk_norm_layers is None or self.qk_norm_layers[layer])

    def kv_window(self) -> int | None:
        """The window when every layer has one (the KV manager may then free the blocks behind it);
        None when any layer attends the whole context (Gemma's global layers keep every block). Recurrent layers
        without K/V do not count (Griffin's: its local attention layers alone decide)."""
        if self.sliding_window is None:
            return None
        windows = {self.window(i) for i in range(self.num_hidden_layers)
                   if not self.is_recurrent(i) or self.cache_layers(i)}
        return self.sliding_window if windows == {self.sliding_window} else None

    def is_conv(self, layer: int) -> bool:
        """Whether ``layer``'s token mixer is a short convolution (``kvserve.model.short_conv``)."""
        return self.conv_layers is not None and self.conv_layers[layer]

    def is_mamba(self, layer: int) -> bool:
        """Whether ``layer``'s token mixer is a Mamba-2 selective state space (``kvserve.model.mamba``)."""
        return self.mamba_layers is not None and self.mamba_layers[layer]

    def has_mixer(self, layer: int) -> bool:
        """Whether ``layer`` has a token mixer (attention, a convolution, a recurrence); not an MLP-only block."""
        return self.layer_parts is None or self.layer_parts[layer] != "mlp"

    def has_mlp(self, layer: int) -> bool:
        """Whether ``layer`` has an MLP or experts; not a mixer-only block."""
        return self.layer_parts is None or self.layer_parts[layer] != "mixer"

    def layout(self, layer: int) -> str:
        """``layer``'s norm layout (``norm_layout``; ``recurrent_norm_layout`` on a recurrent layer where set)."""
        if self.recurrent_norm_layout is not None and self.is_recurrent(layer):
            return self.recurrent_norm_layout
        return self.norm_layout

    def layer_norm_roles(self, layer: int) -> tuple[str, ...]:
        """The norms ``layer`` has: its layout's, less the one before a sublayer it lacks."""
        if self.layer_parts is None or self.layer_parts[layer] == "both":
            roles = roles_of_layout(self.layout(layer))
            if layer == 0 and not self.first_input_norm:
                return tuple(r for r in roles if r != "input_layernorm")
            return roles
        return ("input_layernorm",) if self.layer_parts[layer] == "mixer" else ("post_attention_layernorm",)

    def gated_norm(self, layer: int, role: str) -> bool:
        """Whether ``layer``'s norm ``role`` is gated (``norm_gate_rank``): the input norm, an MoE layer's MLP norm."""
        return bool(self.norm_gate_rank) and (role == "input_layernorm" or
                                              (role == "post_attention_layernorm" and self.is_moe(layer)))

    def has_shared_block(self, layer: int) -> bool:
        """Whether a shared transformer block (``kvserve.model.shared_block``) runs before ``layer``'s mixer."""
        return self.shared_block_layers is not None and self.shared_block_layers[layer]

    def shared_block_use(self, layer: int) -> int:
        """Which use of the shared blocks ``layer``'s is (its adapters' index): the shared layers before it."""
        return sum(self.shared_block_layers[:layer]) if self.shared_block_layers is not None else 0

    def shared_block_of(self, layer: int) -> int:
        """The shared block ``layer`` runs: the blocks take the uses in turn."""
        return self.shared_block_use(layer) % self.shared_blocks

    def swiglu_clips(self, layer: int | None) -> tuple[float | None, float | None]:
        """``layer``'s clips of its experts' and its shared expert's SwiGLU (``expert_clip_layers``; None: none)."""
        return tuple(None if layer is None or not clips or not clips[layer] else float(clips[layer])  # type: ignore
                     for clips in (self.expert_clip_layers, self.shared_expert_clip_layers))

    def is_delta(self, layer: int) -> bool:
        """Whether ``layer``'s token mixer is a gated delta net (``kvserve.model.gated_delta``)."""
        return self.delta_layers is not None and self.delta_layers[layer]

    def is_lru(self, layer: int) -> bool:
        """Whether ``layer``'s token mixer is Griffin's RG-LRU block (``kvserve.model.rglru``)."""
        return self.lru_layers is not None and self.lru_layers[layer]

    def is_rwkv(self, layer: int) -> bool:
        """Whether ``layer`` is an RWKV time or channel mix (``kvserve.model.rwkv``)."""
        return self.rwkv_mix is not None and self.rwkv_mix[layer] in ("time", "channel")

    def is_mlstm(self, layer: int) -> bool:
        """Whether ``layer``'s token mixer is an mLSTM (``kvserve.model.mlstm``; every layer of an xLSTM model)."""
        return self.mlstm is not None and self.has_mixer(layer)

    def is_recurrent(self, layer: int) -> bool:
        """Whether ``layer`` keeps a state per sequence (the whole sequence summed up in a fixed size) instead of KV."""
        return (self.is_mamba(layer) or self.is_delta(layer) or self.is_lru(layer) or self.is_rwkv(layer)
                or self.is_mlstm(layer))

    @property
    def has_recurrent_state(self) -> bool:
        return any(self.is_recurrent(i) for i in range(self.num_hidden_layers))

    def cache_layers(self, layer: int) -> int:
        """How many of the KV pool's layers ``layer`` takes: 1 (its K and V), none for a recurrent layer (its state is
        per sequence), or for a short convolution as many as hold its input (hidden_size values a token) in their
        K's and V's widths."""
        if not self.has_mixer(layer) or self.shares_kv(layer) or \
                (self.is_recurrent(layer) and not self.parallel_attention and not self.has_shared_block(layer)):
            return 0
        if not self.is_conv(layer):
            return 1
        return -(-self.hidden_size // (2 * self.num_key_value_heads * int(self.head_dim or 0)))

    def attn_head_dim(self, layer: int) -> int:
        return int(self.head_dim or 0) if self.layer_head_dims is None else self.layer_head_dims[layer]

    def cache_head_dim(self, layer: int) -> int:
        """The width of ``layer``'s cached K/V heads: its head_dim, twice that for differential attention (the value
        pairs side by side), and two more for a key bias (Doge's dynamic mask)."""
        return self.attn_head_dim(layer) * (2 if self.diff_attention else 1) + (2 if self.key_bias else 0)

    def attn_kv_heads(self, layer: int) -> int:
        return self.num_key_value_heads if self.layer_kv_heads is None else self.layer_kv_heads[layer]

    def mlp_size(self, layer: int) -> int:
        return self.intermediate_size if self.layer_intermediate_sizes is None else self.layer_intermediate_sizes[layer]

    def mlp_sparsity(self, layer: int) -> float:
        """The share of ``layer``'s MLP gate values cut to 0 (``activation_sparsity``; 0: none)."""
        return 0.0 if self.activation_sparsity is None else float(self.activation_sparsity[layer])

    def shares_kv(self, layer: int) -> bool:
        """Whether ``layer`` attends over an earlier layer's K/V (``kv_shared_from``) instead of its own."""
        return self.kv_shared_from is not None and self.kv_shared_from[layer] != layer

    def kv_layer_shapes(self) -> list[tuple[int, int]] | None:
        """(K/V heads, head dim) of each KV pool layer where they differ between layers; None where they are all
        (num_key_value_heads, head_dim)."""
        if self.layer_head_dims is None and self.layer_kv_heads is None and not (self.diff_attention or self.key_bias):
            return None
        from kvserve.model.index_cache import index_pool_layers

        shapes = [(self.attn_kv_heads(i), self.cache_head_dim(i)) for i in range(self.num_hidden_layers)
                  for _ in range(self.cache_layers(i))]
        shapes += [(self.num_key_value_heads, int(self.head_dim or 0))] * index_pool_layers(self)  # (the model's shape)
        return None if set(shapes) <= {(self.num_key_value_heads, int(self.head_dim or 0))} else shapes

    @property
    def kv_cache_layers(self) -> int:
        """The KV pool's layers (``KVLayout.num_layers``): one an attention layer, a convolution's, indexers' keys."""
        from kvserve.model.index_cache import index_pool_layers

        return sum(self.cache_layers(i) for i in range(self.num_hidden_layers)) + index_pool_layers(self)

    def runs_indexer(self, layer: int) -> bool:
        """Whether ``layer`` runs a lightning indexer of its own (the others reuse the last one's choice)."""
        return self.indexes(layer) and (self.index_layers is None or self.index_layers[layer])

    def indexes(self, layer: int) -> bool:
        """Whether ``layer`` attends an indexer's choice of keys: a windowed layer attends its window instead (Dots 3)."""
        return bool(self.index_topk) and self.window(layer) is None

    def latent_dims(self, layer: int) -> tuple[int, int, int, int, int]:
        """``layer``'s latent attention: (q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim)."""
        if self.latent_layer_dims is not None:
            return tuple(self.latent_layer_dims[layer])  # type: ignore[return-value]
        return self.q_lora_rank, self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim

    def is_moe(self, layer: int) -> bool:
        return bool(self.num_experts) and (self.moe_layers is None or self.moe_layers[layer]) and self.has_mlp(layer)

    def has_shortcut_moe(self, layer: int) -> bool:
        return self.moe_shortcut and layer % 2 == 0 and layer + 1 < self.num_hidden_layers

    def rotates(self, layer: int) -> bool:
        """Whether ``layer``'s q and k take rotary embeddings."""
        return not self.learned_positions and (self.rope_layers is None or self.rope_layers[layer])
