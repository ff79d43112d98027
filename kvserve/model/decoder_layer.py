"""DecoderLayer: one layer of the decoder (``kvserve.model.decoder``): its token mixer (attention, latent attention, a
short convolution, a Mamba or delta-net layer) and its MLP or experts, with their norms in the architecture's layout,
and what some close a layer with (experts beside the MLP, a per-layer input's branch, a scalar)."""

from __future__ import annotations

import math

import torch
from torch import nn

from kvserve.model.altup import AltUp, Laurel, altup_layer_forward
from kvserve.model.attention import Attention, rms_unweighted
from kvserve.model.config import ModelConfig
from kvserve.model.gated_delta import GatedDeltaNet
from kvserve.model.kimi_delta import KimiDeltaAttention
from kvserve.model.latent_attention import LatentAttention
from kvserve.model.layers import GatedRMSNorm, NoNorm, RMSNorm, make_norm, padded_rows
from kvserve.model.lightning import LightningAttention
from kvserve.model.mamba import AttentionBesideMamba, Mamba1, Mamba2
from kvserve.model.mlp import GatedMLP, MoE, activation
from kvserve.model.mlstm import MLSTM
from kvserve.model.rglru import RGLRU
from kvserve.model.routed_attention import RoutedQueryAttention
from kvserve.model.rwkv import RwkvChannelMix, RwkvTimeMix
from kvserve.model.shared_block import SharedBlock, SharedBlockUse
from kvserve.model.short_conv import ShortConv


def make_moe(cfg: ModelConfig, layer: int | None = None) -> MoE:
    """The experts ``cfg`` describes (a layer's, or its shortcut's); ``layer``'s SwiGLU clips where set."""
    return MoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob,
               cfg.hidden_act, cfg.shared_expert_intermediate_size, cfg.router_bias, cfg.expert_bias, cfg.swiglu,
               cfg.shared_expert_gated, cfg.selection_bias, cfg.router_scoring, cfg.routed_scale,
               cfg.expert_group_choice, cfg.router_jitter, cfg.gated_mlp, cfg.moe_scale_inputs,
               cfg.rms_norm_eps if cfg.moe_out_norm else None, cfg.selection_on_logits, cfg.identity_experts,
               cfg.router_logit_softcap, cfg.moe_out_bias, *cfg.swiglu_clips(layer),
               cfg.rms_norm_eps if cfg.expert_out_norm else None)


def depth_mix(n: int) -> tuple[float, float]:
    """The n-th residual add's (a, b) by depth (Beam's): out / sqrt(n) + stream * sqrt((n - 1) / n)."""
    return 1 / math.sqrt(n), math.sqrt((n - 1) / n)


def gated_mix(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Ergo's residual gate's (a, b) per dim from its weight w: a = sigmoid(w), b = sqrt(1 + a) * exp(-softplus(w) / 2)
    (in float32)."""
    w = w.float()
    a = torch.sigmoid(w)
    return a, torch.sqrt(1.0 + a) * torch.exp(-0.5 * torch.nn.functional.softplus(w))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layout = cfg.layout(layer)
        # before attention and before the MLP ("pre"; "parallel": the first only), on their outputs ("post"), or both
        for role in cfg.layer_norm_roles(layer):
            setattr(self, role, GatedRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_gate_rank)
                    if cfg.gated_norm(layer, role) else make_norm(cfg.norm_type, cfg.hidden_size, cfg.rms_norm_eps,
                                                                  cfg.norm_bias, cfg.norm_affine))
        if layer == 0 and not cfg.first_input_norm:  # (its input, the embeddings, normed already)
            self.input_layernorm = NoNorm()
        # the layer's token mixer: attention, latent attention, a short convolution, a Mamba-2 layer or a gated delta net
        self.self_attn: (Attention | LatentAttention | ShortConv | Mamba1 | Mamba2 | AttentionBesideMamba | GatedDeltaNet
                         | RGLRU | RwkvTimeMix | RwkvChannelMix | MLSTM | KimiDeltaAttention | LightningAttention
                         | RoutedQueryAttention | None)
        if not cfg.has_mixer(layer):  # an MLP-only block
            self.self_attn = None
        elif cfg.is_mamba(layer) and cfg.parallel_attention:
            self.self_attn = AttentionBesideMamba(cfg, layer, Attention(cfg, layer))
        elif cfg.is_mamba(layer):
            self.self_attn = Mamba2(cfg, layer) if cfg.mamba_version == 2 else Mamba1(cfg, layer)
        elif cfg.is_delta(layer):
            mixers = {"kimi": KimiDeltaAttention, "lightning": LightningAttention}
            self.self_attn = mixers.get(cfg.delta_rule, GatedDeltaNet)(cfg, layer)
        elif cfg.is_lru(layer):
            self.self_attn = RGLRU(cfg, layer)
        elif cfg.is_mlstm(layer):
            self.self_attn = MLSTM(cfg, layer)
        elif cfg.is_rwkv(layer):
            rwkv = RwkvTimeMix if cfg.rwkv_mix[layer] == "time" else RwkvChannelMix  # type: ignore[index]
            self.self_attn = rwkv(cfg, layer)
        elif cfg.is_conv(layer):
            self.self_attn = ShortConv(cfg, layer)
        elif cfg.attention_experts:
            self.self_attn = RoutedQueryAttention(cfg, layer)
        else:
            self.self_attn = LatentAttention(cfg, layer) if cfg.kv_lora_rank else Attention(cfg, layer)
        # a shared transformer block's use before the mixer (Zamba): this layer's adapters and linear
        self.shared_use = SharedBlockUse(cfg) if cfg.has_shared_block(layer) else None
        self.mlp: GatedMLP | MoE | None = None  # (None: a mixer-only block)
        self.moe: MoE | None = None  # experts beside the dense MLP (ModelConfig.moe_beside_mlp)
        if cfg.is_moe(layer):
            self.mlp = make_moe(cfg, layer)
        if cfg.has_mlp(layer) and (not cfg.is_moe(layer) or cfg.moe_beside_mlp):
            self.moe = self.mlp if cfg.moe_beside_mlp else None  # type: ignore[assignment]
            self.mlp = GatedMLP(cfg.hidden_size, cfg.mlp_size(layer), cfg.hidden_act, cfg.mlp_bias, cfg.swiglu,
                                cfg.gated_mlp, cfg.rms_norm_eps if cfg.mlp_sub_norm else None, cfg.mlp_sparsity(layer))
            if cfg.mlp_sub_norm and cfg.norm_type == "l2":  # (Dory's: weightless, over the sum of squares)
                self.mlp.sub_norm = make_norm("l2", cfg.mlp_size(layer), cfg.rms_norm_eps)
        # what closes the layer after its MLP (Gemma 4): a per-layer input's gated branch, a scalar on its output
        self.extras = cfg.moe_beside_mlp or bool(cfg.per_layer_input_size) or cfg.layer_scalars
        if self.extras:
            if self.layout != "sandwich":
                raise ValueError("experts beside the MLP, per-layer inputs and layer scalars take the sandwich layout")
            self.eps = cfg.rms_norm_eps
            extra_norms = ["moe_mlp_out_norm", "moe_in_norm", "experts_out_norm"] if self.moe is not None else []
            if cfg.per_layer_input_size:
                extra_norms.append("per_layer_norm")
                self.per_layer_gate = nn.Linear(cfg.hidden_size, cfg.per_layer_input_size, bias=False)
                self.per_layer_proj = nn.Linear(cfg.per_layer_input_size, cfg.hidden_size, bias=False)
                self.per_layer_act = activation(cfg.hidden_act)
            for role in extra_norms:
                setattr(self, role, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps))
            self.layer_scalar = nn.Parameter(torch.ones(1)) if cfg.layer_scalars else None
        # experts beside the MLP on its input, their output added after the next layer's MLP (ModelConfig.moe_shortcut):
        # kept in ``deferred`` for the model's loop to hand on
        self.shortcut = make_moe(cfg) if cfg.has_shortcut_moe(layer) else None
        self.deferred: torch.Tensor | None = None
        # Gemma 3n: the layer runs over several residual streams, with LAuReL's branch beside attention
        self.altup = None if cfg.altup_streams < 2 else AltUp(cfg.hidden_size, cfg.altup_streams, cfg.altup_active,
                                                              cfg.rms_norm_eps, cfg.altup_correct_scale)
        self.laurel = Laurel(cfg.hidden_size, cfg.laurel_rank, cfg.rms_norm_eps) if cfg.laurel_rank else None
        self.residual_scale = cfg.residual_scale
        # the stream weighted per channel before each sublayer's add (Doge's)
        self.residual_weights = cfg.residual_weights
        if self.residual_weights:
            self.attn_residual = nn.Parameter(torch.ones(cfg.hidden_size))
            self.mlp_residual = nn.Parameter(torch.ones(cfg.hidden_size))
        self.scales = cfg.sublayer_scales[layer] if cfg.sublayer_scales else (1.0, 1.0, 1.0, 1.0)
        # (a, b) of each add, attention's then the MLP's, where the stream takes a * out + b * stream (residual_mix)
        self.mix = None if cfg.residual_mix != "depth" else [depth_mix(2 * layer + 2), depth_mix(2 * layer + 3)]
        # "gated": each add's learned weights (attention's, then the MLP's), mixed by ``gated_mix``
        self.residual_gates = nn.Parameter(torch.zeros(2 * cfg.hidden_size)) \
            if cfg.residual_mix in ("gated", "interpolate") else None
        self.interpolates = cfg.residual_mix == "interpolate"  # (nGPT's: the stream moves towards each normed output)
        # the bf16 hand-offs between the norms and the AMX GEMMs: Llama's layout and plain attention only
        self.one_part = self.self_attn is None or self.mlp is None
        self.fast = (self.layout == "pre" and not self.one_part and self.self_attn.plain and cfg.residual_scale == 1
                     and not self.residual_weights)
        # and into the MLP, whose down projection then writes bf16: not where it adds a bias (added in float32
        # instead, as the native decode stack adds it)
        self.fast_mlp = self.fast and not cfg.mlp_bias and not cfg.mlp_sub_norm and self.shortcut is None
        if cfg.residual_mix not in (None, "depth", "gated", "interpolate"):
            raise ValueError(f"residual_mix {cfg.residual_mix!r} is not supported (depth, gated, interpolate)")
        if cfg.residual_mix is not None and (self.layout != "sandwich" or self.extras or self.one_part
                                             or self.altup is not None or self.shortcut is not None):
            raise ValueError("residual_mix is built for sandwich layers of attention then an MLP, nothing after it")

    def forward(self, h, delta, rope, attn, meta, kv_cache, rows: torch.Tensor | None = None,
                per_layer: torch.Tensor | None = None, shared: tuple[SharedBlock, torch.Tensor] | None = None,
                reduced: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Adds ``delta`` (the previous layer's MLP output, or None) to the residual stream ``h`` in
        place, then this layer's attention output; returns the stream and this layer's MLP output, for
        the next layer's norm (or the final one) to add in the same pass as its own.

        ``rows`` (the last layer, when the caller reads only the rows it samples): every row's K/V is
        written, but attention, the MLP and the returned stream are those rows' only.
        ``per_layer``: this layer's per-layer input [T, per_layer_input_size] (ModelConfig.per_layer_input_size).
        ``reduced``: ``h`` (and ``per_layer``) hold ``rows``' rows only already (a layer after the one that cut them:
        ``CausalLM.rows_from``).
        ``shared``: the shared block this layer uses and the step's embeddings (ModelConfig.shared_block_layers).

        On an AMX step the norms write bf16 (what the GEMMs read) and the GEMMs' bf16 outputs go
        into the float32 residual as they are: no conversion passes between them."""
        t = h.shape[0]
        if self.altup is not None:  # (h: the streams [n, T, hidden])
            return altup_layer_forward(self, h, rope, attn, meta, kv_cache, rows, per_layer)
        if self.interpolates:
            return self._interpolated_forward(h, delta, rope, attn, meta, kv_cache, rows)
        if self.extras:
            return self._closed_forward(h, delta, rope, attn, meta, kv_cache, rows, per_layer, reduced)
        if self.residual_weights:
            return self._weighted_forward(h, delta, rope, attn, meta, kv_cache, rows)
        if self.one_part:
            return self._one_part_forward(h, delta, rope, attn, meta, kv_cache, rows, shared)
        if self.layout.startswith("parallel"):
            return self._parallel_forward(h, delta, rope, attn, meta, kv_cache, rows)
        if self.layout == "post_add":
            return self._post_add_forward(h, delta, rope, attn, meta, kv_cache, rows)
        if self.layout == "normed_residual":
            return self._normed_residual_forward(h, delta, rope, attn, meta, kv_cache, rows)
        bf16_attn = self.fast and self.self_attn.runs_bf16(h, attn, meta, kv_cache)
        if self.layout == "post":
            x = h if delta is None else h.add_(delta)
        else:  # the norms write the bf16 GEMMs' inputs already padded to the rows oneDNN gets (padded_rows)
            x = self.input_layernorm.add_forward(h, delta, *((torch.bfloat16, padded_rows(t)) if bf16_attn else ()))
        x = self.self_attn(x, rope, attn, meta, kv_cache, bf16_attn, rows, t)
        if rows is not None:
            h = h[rows]
            if not rows.numel():
                return h, None
        x = self._out(x, "attn_out_norm")
        if self.layout == "post":
            x = h.add_(x)
        else:
            x = self._mixed(h, x, 0)
            bf16_mlp = self.fast_mlp and isinstance(self.mlp, GatedMLP) and self.mlp.runs_amx(h)
            x = self.post_attention_layernorm.add_forward(h, x, *((torch.bfloat16, padded_rows(h.shape[0])) if bf16_mlp
                                                                  else ()))
        if self.shortcut is not None:
            self.deferred = self.shortcut(x[: h.shape[0]])
        return h, self._mixed(h, self._out(self.mlp(x)[: h.shape[0]], "mlp_out_norm"), 1)

    def _interpolated_forward(self, h, delta, rope, attn, meta, kv_cache,
                              rows: torch.Tensor | None) -> tuple[torch.Tensor, None]:
        """nGPT's layer (Dory's): the stream normed, moved towards attention's normed output at a rate per dim
        (|residual_gates|, folded at load), normed again, then moved towards the MLP's the same way."""
        x = self.input_layernorm(h if delta is None else h + delta)
        a = self.self_attn(x, rope, attn, meta, kv_cache, False, rows, x.shape[0])
        if rows is not None:
            x = x[rows]
            if not rows.numel():
                return x, None
        rate = self.residual_gates.view(2, -1).float().abs()
        x = self.post_attention_layernorm(x + rate[0] * (self.attn_out_norm(a) - x))
        return x + rate[1] * (self.mlp_out_norm(self.mlp(x)) - x), None

    def _mixed(self, h: torch.Tensor, out: torch.Tensor, part: int) -> torch.Tensor:
        """``out`` as the stream adds it where the layer mixes the two (``mix``): the stream scaled here in place."""
        if self.residual_gates is not None:
            a, b = gated_mix(self.residual_gates.view(2, -1)[part])
        elif self.mix is not None:
            a, b = self.mix[part]
        else:
            return out
        h.mul_(b)
        return out * a

    def _closed_forward(self, h, delta, rope, attn, meta, kv_cache, rows: torch.Tensor | None,
                        per_layer: torch.Tensor | None, reduced: bool = False) -> tuple[torch.Tensor, None]:
        """The sandwich layout with what follows the MLP: experts beside it (the router reading the stream before the
        MLP's norm), the per-layer input's branch, the scalar. The whole output joins the stream here (no delta)."""
        a = self.self_attn(self.input_layernorm.add_forward(h, delta), rope, attn, meta, kv_cache, False, rows,
                           h.shape[0])
        if rows is not None:
            if not reduced:
                h = h[rows]
                per_layer = None if per_layer is None else per_layer[rows]
            if not rows.numel():
                return h, None
        m = self.mlp(self.post_attention_layernorm.add_forward(h, self.attn_out_norm(a)))
        if self.moe is not None:
            route = rms_unweighted(h, self.eps)
            m = self.moe_mlp_out_norm(m) + self.experts_out_norm(self.moe(self.moe_in_norm(h), route))
        h.add_(self.mlp_out_norm(m))
        if per_layer is not None:
            branch = self.per_layer_act(self.per_layer_gate(h)) * per_layer
            h.add_(self.per_layer_norm(self.per_layer_proj(branch)))
        if self.layer_scalar is not None:
            h.mul_(self.layer_scalar)
        return h, None

    def _one_part_forward(self, h, delta, rope, attn, meta, kv_cache, rows: torch.Tensor | None,
                          shared: tuple[SharedBlock, torch.Tensor] | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A block of one sublayer, the mixer or the MLP, after its norm: its output is the delta the next norm adds.
        A shared block's output (mapped by this layer's linear) joins the mixer's input, not the stream."""
        if self.shared_use is not None:
            assert shared is not None and self.self_attn is not None
            if delta is not None:
                h.add_(delta)
            extra = self.shared_use(shared[0], h, shared[1], rope, attn, meta, kv_cache)
            x = self.self_attn(self.input_layernorm(h + extra), rope, attn, meta, kv_cache, False, rows, h.shape[0])
        elif self.self_attn is not None:
            x = self.self_attn(self.input_layernorm.add_forward(h, delta), rope, attn, meta, kv_cache, False, rows,
                               h.shape[0])
        else:
            assert self.mlp is not None
            x = self.post_attention_layernorm.add_forward(h, delta)
            x = x if rows is None else x[rows]
            x = self.mlp(x) if x.shape[0] else x
        if rows is not None:
            h = h[rows]
            if not rows.numel():
                return h, None
        return h, self._out(x, "")

    def _parallel_forward(self, h, delta, rope, attn, meta, kv_cache,
                          rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attention and the MLP over the same input, normed once ("parallel") or by a norm each ("parallel_two"):
        attention's output joins the stream here, the MLP's is the delta (the sum in the checkpoints' order: residual
        + attention, then + MLP)."""
        t = h.shape[0]
        x = self.input_layernorm.add_forward(h, delta)
        mlp_in = self.post_attention_layernorm(h) if self.layout == "parallel_two" else x
        a = self.self_attn(x, rope, attn, meta, kv_cache, False, rows, t)
        if rows is not None:
            h, mlp_in = h[rows], mlp_in[rows]
            if not rows.numel():
                return h, None
        h.add_(self._out(a, ""))
        return h, self._out(self.mlp(mlp_in)[: h.shape[0]], "")

    def _post_add_forward(self, h, delta, rope, attn, meta, kv_cache,
                          rows: torch.Tensor | None) -> tuple[torch.Tensor, None]:
        """The stream normed after each add (the original Transformer's post-norm): norm(h + attention(h)), then
        norm(that + MLP(that)); the result is the stream itself, so no delta goes on to the next layer."""
        if delta is not None:
            h.add_(delta)
        a = self.self_attn(h, rope, attn, meta, kv_cache, False, rows, h.shape[0])
        if rows is not None:
            h = h[rows]
            if not rows.numel():
                return h, None
        x = self.attn_out_norm(h + self._out(a, ""))
        return self.mlp_out_norm(x + self._out(self.mlp(x), "")), None

    def _weighted_forward(self, h, delta, rope, attn, meta, kv_cache,
                          rows: torch.Tensor | None) -> tuple[torch.Tensor, None]:
        """Llama's pre-norm layer with the stream weighted per channel before each add (attn_residual * h + attention,
        then mlp_residual * that + MLP): the layer's output is the stream itself, no delta goes on."""
        if delta is not None:
            h.add_(delta)
        a = self.self_attn(self.input_layernorm(h), rope, attn, meta, kv_cache, False, rows, h.shape[0])
        if rows is not None:
            h = h[rows]
            if not rows.numel():
                return h, None
        h = h * self.attn_residual + self._out(a, "")
        return h * self.mlp_residual + self._out(self.mlp(self.post_attention_layernorm(h)), ""), None
    def _normed_residual_forward(self, h, delta, rope, attn, meta, kv_cache,
                                 rows: torch.Tensor | None) -> tuple[torch.Tensor, None]:
        """MiniMax's: each norm's output is the residual its sublayer's output joins, x = a n + b sublayer(n) with n
        the norm of the stream (``sublayer_scales``); the result is the stream itself, so no delta goes on."""
        res_a, out_a, res_m, out_m = self.scales
        if delta is not None:
            h.add_(delta)
        n = self.input_layernorm(h)
        a = self.self_attn(n, rope, attn, meta, kv_cache, False, rows, h.shape[0])
        if rows is not None:
            n = n[rows]
            if not rows.numel():
                return n, None
        n = self.post_attention_layernorm(n * res_a + a * out_a)
        return n * res_m + self.mlp(n) * out_m, None

    def _out(self, x: torch.Tensor, norm: str) -> torch.Tensor:
        """A sublayer's output as the residual stream takes it: normed (sandwich and post layouts), scaled."""
        if self.layout in ("post", "sandwich"):
            x = getattr(self, norm)(x)
        return x * self.residual_scale if self.residual_scale != 1 else x
