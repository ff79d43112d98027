"""The options of the token mixers other than attention, which ``ModelConfig`` takes on (keyword-only): short
convolutions, Mamba-1 and Mamba-2, gated delta nets and their kin (Kimi's, lightning attention), Griffin's RG-LRU, RWKV-4's
mixes and xLSTM's mLSTM. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.model.layer_plan import MLSTMShape


@dataclass(kw_only=True)
class MixerOptions:
    # --- short convolutions (LFM2): per layer, whether its token mixer is a gated depthwise causal convolution of
    # conv_kernel taps (with a bias where conv_bias) instead of attention; None: every layer attends ---
    conv_layers: list[bool] | None = None
    conv_kernel: int = 0
    conv_bias: bool = False
    # --- Mamba-2 layers (Granite 4.0 H, Bamba): per layer, whether its token mixer is a selective state space of
    # mamba_heads heads of mamba_head_dim, mamba_groups groups of B and C of mamba_state_size, after a depthwise causal
    # convolution of mamba_conv_kernel taps; a recurrent state per sequence (kvserve.model.mamba) ---
    mamba_layers: list[bool] | None = None
    mamba_heads: int = 0
    mamba_head_dim: int = 0
    mamba_groups: int = 1
    mamba_state_size: int = 0
    mamba_conv_kernel: int = 4
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    mamba_dt_limit: tuple[float, float] = (0.0, float("inf"))
    # Mamba-1 (Mamba, Falcon Mamba): mamba_version 1, its selective scan per channel of mamba_inner, a state of
    # mamba_state_size each, dt through a rank-mamba_dt_rank projection; dt, B and C RMS-normed without weights where
    # mamba_bcdt_norm_eps is set (Falcon Mamba)
    mamba_version: int = 2
    mamba_inner: int = 0  # (Mamba-2: mamba_heads x mamba_head_dim where not given)
    mamba_dt_rank: int = 0
    mamba_bcdt_norm_eps: float | None = None
    mamba_bcdt_norm_weights: bool = False  # those norms with weights (Jamba's dt_layernorm, b_layernorm, c_layernorm)
    # Mamba-2's output: "gated" RMSNorm per group of y * silu(z) (the default), "norm_then_gate" (the norm of y, then
    # times silu(z)), or "none" (y * silu(z): Falcon-H1 without mamba_rms_norm); out_proj's bias where it differs
    mamba_norm: str = "gated"
    mamba_out_bias: bool | None = None
    # --- gated delta nets (Qwen3-Next, Qwen3.5): per layer, whether its token mixer is linear attention with the gated
    # delta rule, q/k in delta_key_heads heads of delta_key_dim, v in delta_value_heads of delta_value_dim, after a
    # depthwise causal convolution of delta_conv_kernel taps; a recurrent state per sequence (kvserve.model.gated_delta)
    delta_layers: list[bool] | None = None
    delta_key_heads: int = 0
    delta_value_heads: int = 0
    delta_key_dim: int = 0
    delta_value_dim: int = 0
    delta_conv_kernel: int = 4
    # --- Griffin's RG-LRU layers (RecurrentGemma; kvserve.model.rglru): per layer, whether its token mixer is the
    # recurrent block of lru_width channels, gates block-diagonal in lru_blocks, a convolution of lru_conv_kernel taps
    lru_layers: list[bool] | None = None
    lru_width: int = 0
    lru_blocks: int = 1
    lru_conv_kernel: int = 4
    # --- RWKV-4 (kvserve.model.rwkv): per layer "time" (the time mix, its k/v/r of rwkv_attention_size) or "channel"
    # (the channel mix, of intermediate_size), each a block's half after its own norm; None: no RWKV layers ---
    rwkv_mix: list[str] | None = None
    rwkv_attention_size: int = 0
    mlstm: MLSTMShape | None = None  # xLSTM's mLSTM layers (every layer's mixer), their shapes and gates
    # Kimi Delta Attention (kvserve.model.kimi_delta): "kimi" decays each key channel on its own, from a projection of
    # rank delta_gate_rank, and gates the output by a sigmoid of another; "gated": Qwen3-Next's rule
    delta_rule: str = "gated"  # also "lightning" (kvserve.model.lightning: MiniMax's linear attention, no delta rule)
    delta_gate_rank: int = 0
    delta_decay_bound: float | None = None  # Ling 3's bounded ("safe") decay: its log is bound x a sigmoid (kimi_delta)
