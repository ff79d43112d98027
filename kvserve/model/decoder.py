"""The decoder every architecture is built as: embeddings, layers (attention and a gated MLP or a mixture of
experts, their norms in the architecture's layout), the final norm and the LM head; loading a checkpoint
into it, and the CPU fast paths (oneDNN-packed and quantized linears, native ops, the native decode stack,
the LM head's own draw). The options come from ``ModelConfig``; ``kvserve.model.architectures`` registers
what each architecture turns on."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from kvserve.attention import AttentionBackend, AttentionMetadata
from kvserve.model.altup import AltUpStreams
from kvserve.model.config import ModelConfig
from kvserve.model.cycles import RecurrentLoops, StackCycles
from kvserve.model.decoder_layer import DecoderLayer
from kvserve.model.index_cache import index_slot
from kvserve.model.layers import NoNorm, PackedLinear, RMSNorm, make_norm, pack_linears, padded_rows
from kvserve.model.mlp import GatedMLP, MoE
from kvserve.model.moe_native import moe_blocker
from kvserve.model.native_stack import build_native_stack, native_stack_blocker, run_native_stack
from kvserve.model.prediction_head import NormedHead
from kvserve.model.quant import QuantWeight
from kvserve.model.recurrent import RecurrentMixer
from kvserve.model.quant_linear import AMX_MIN_ROWS, QuantEmbedding, QuantLinear
from kvserve.model.rotary import Rotary, RotaryStep
from kvserve.model.shared_block import SharedBlock

log = logging.getLogger(__name__)


class CausalLM(nn.Module):
    """Any registered architecture (``kvserve.model.architectures``), from its ``ModelConfig``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_positions = nn.Embedding(cfg.max_position_embeddings + cfg.position_offset, cfg.hidden_size) \
            if cfg.learned_positions else None
        self.embed_norm = make_norm(cfg.norm_type, cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_bias, cfg.norm_affine) \
            if cfg.embed_norm else None
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        # transformer blocks the layers of shared_block_layers take in turn (Zamba), each built for its first user
        users = [i for i in range(cfg.num_hidden_layers) if cfg.has_shared_block(i)]
        self.shared_blocks = nn.ModuleList(SharedBlock(cfg, users[b])
                                           for b in range(min(cfg.shared_blocks, len(users)))) if users else None
        self.norm = make_norm(cfg.norm_type, cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_bias, cfg.norm_affine) \
            if cfg.final_norm else NoNorm()
        if cfg.head_transform is not None:  # the final norm with ModernBERT's prediction head after it
            self.norm = NormedHead(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_bias, cfg.head_transform,
                                   cfg.head_transform_bias)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size,
                                                                      cfg.output_vocab_size or cfg.vocab_size,
                                                                      bias=cfg.lm_head_bias)
        head_dim = int(cfg.head_dim or 0)
        # the global layers' heads, where they differ from the sliding layers' (Gemma 4)
        full_dim = next((cfg.attn_head_dim(i) for i in range(cfg.num_hidden_layers) if cfg.window(i) is None), head_dim)
        self.rotary = Rotary(cfg.rotary_dim * full_dim // max(head_dim, 1), cfg.max_position_embeddings, cfg.rope_theta,
                             cfg.rope_scaling, full_dim)
        # Gemma 3's sliding layers rotate with their own base, unscaled (Laguna's: over their own share of each head;
        # GraniteSWA's chosen layers: scaled as the global ones)
        local_share = cfg.rope_local_partial_rotary_factor
        self.local_rotary = None if cfg.rope_local_theta is None else Rotary(
            cfg.rotary_dim if local_share is None else int(head_dim * local_share), cfg.max_position_embeddings,
            cfg.rope_local_theta, cfg.rope_scaling if cfg.rope_local_scaled else None, head_dim)
        self.uses_local = [cfg.rope_local_theta is not None and (
            cfg.window(i) is not None if cfg.rope_local_layers is None else cfg.rope_local_layers[i])
            for i in range(len(self.layers))]
        self.rotates = [cfg.rotates(i) for i in range(len(self.layers))]  # SmolLM3's NoPE layers: False
        # each layer's pool layers (kv_caches' entries): its own one, a short convolution's several, a Mamba layer's
        # none
        self.cache_of: list[int | slice] = []
        first = 0
        for i in range(len(self.layers)):
            n = cfg.cache_layers(i)
            if cfg.shares_kv(i):  # it reads the K/V the earlier layer writes
                self.cache_of.append(self.cache_of[cfg.kv_shared_from[i]])  # type: ignore[index]
                continue
            self.cache_of.append(first if n == 1 and not cfg.is_conv(i) else slice(first, first + n))
            first += n
        # the first layer of those at the end that write no K/V (they attend over earlier layers'): a prompt chunk's rows
        # that sample nothing stop there (vLLM's KV-sharing fast prefill; transformers' generate does the same)
        self.rows_from: int | None = None
        if cfg.kv_shared_from is not None and all(layer.extras and layer.altup is None for layer in self.layers):
            tail = [i for i in range(len(self.layers)) if all(cfg.shares_kv(j) for j in range(i, len(self.layers)))]
            self.rows_from = tail[0] if tail else None
        # the pool layer holding a layer's indexer keys (kvserve.model.index_cache), handed to it beside its own
        self.index_pool = [index_slot(cfg, i)[0] if cfg.runs_indexer(i) else None for i in range(len(self.layers))]
        if cfg.per_layer_input_size:  # per-layer inputs: a table a token, and a projection of the embeddings
            width = cfg.num_hidden_layers * cfg.per_layer_input_size
            self.per_layer_embed = nn.Embedding(cfg.per_layer_vocab_size, width)
            self.per_layer_model_proj = nn.Linear(cfg.hidden_size, width, bias=False)
            self.per_layer_proj_norm = RMSNorm(cfg.per_layer_input_size, cfg.rms_norm_eps)
        # Gemma 3n's residual streams: made from the embeddings before the layers, folded into one after them
        self.altup_streams = AltUpStreams(cfg.hidden_size, cfg.altup_streams) if cfg.altup_streams > 1 else None
        # HRM's stacks over two streams, Dory's looped layers
        self.cycles = StackCycles(cfg) if cfg.stack_cycles is not None else \
            RecurrentLoops(cfg) if cfg.recurrent_loops is not None else None
        self.native = False
        self.native_stack: Any | None = None  # every layer in one native call (kvserve.model.native_stack)
        self.lora: Any | None = None  # a kvserve.lora.layers.LoRAContext once adapters are enabled

    def recurrent_layers(self) -> list[RecurrentMixer]:
        return [m for m in self.modules() if isinstance(m, RecurrentMixer)]

    def state_bytes(self, dtype: torch.dtype) -> int:
        """Bytes one sequence's recurrent state takes over every layer (0: the model keeps none)."""
        return sum(m.state_bytes(dtype) for m in self.recurrent_layers())

    def allocate_states(self, slots: int, dtype: torch.dtype, device: torch.device) -> None:
        """Room for ``slots`` sequences' recurrent states (``KVManager.state_slot`` indexes them)."""
        for m in self.recurrent_layers():
            m.allocate_states(slots, dtype, device)

    @classmethod
    def from_hf_weights(cls, cfg: ModelConfig, weights: dict[str, Any], dtype: torch.dtype,
                        device: torch.device, quantization: str = "none", amx: bool | None = None) -> "CausalLM":
        """The model over checkpoint ``weights`` (``kvserve.model.assemble.build_model``); ``amx`` False: no bf16
        AMX copies of the quantized linears (None: where the CPU has AMX)."""
        from kvserve.model.assemble import build_model

        return build_model(cls, cfg, weights, dtype, device, quantization, amx)

    def use_native_ops(self, on: bool = True) -> None:
        """Norms, rotary and the MLP's activation through the fused CPU kernels (kvserve.kernels)."""
        self.native = on
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.native = on
            elif isinstance(m, (GatedMLP, MoE)):
                m.use_native(on)
            elif isinstance(m, RecurrentMixer):
                m.native = on
        self.native_stack = None
        if on:
            why = native_stack_blocker(self.config)
            if why is None:
                self.native_stack = build_native_stack(self)
            else:
                log.info("%s: decode steps run the Python layers (the native decode stack does not run every "
                         "option; this model has %s)", self.config.architecture, why)
                # (where the stack runs, build_native_stack says why an MoE layer's experts cannot)
                moe = next((m for m in self.modules() if isinstance(m, MoE) and m.native_block is None), None)
                if moe is not None:
                    log.info("%s: the experts run the Python loop of experts (%s)", self.config.architecture,
                             moe_blocker(moe))

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        keep_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, for a flat ragged batch of T tokens;
        ``attn`` attends over ``kv_caches`` (per layer K, V) with the step's ``meta``.

        ``keep_rows`` (int64 row indices, each sequence's ascending): the caller reads only these rows
        (those it samples), so the last layer attends and runs its MLP for them alone (every row's K/V
        is still written): the result is [len(keep_rows), hidden]. A prefill chunk samples one row of
        hundreds, so this saves most of a layer."""
        h = self.embed_tokens(input_ids)  # a fresh tensor: the layers add to it in place
        if self.config.embed_scale != 1:  # in the hidden dtype, as transformers scales
            h = h * torch.tensor(self.config.embed_scale, dtype=h.dtype)
        if self.embed_positions is not None:
            h = h + self.embed_positions(positions + self.config.position_offset).to(h.dtype)
        if self.embed_norm is not None:
            h = self.embed_norm(h)
        # a step with adapter rows runs the Python layers: the native stack has no LoRA
        lora_rows = self.lora is not None and self.lora.step is not None
        if self.native_stack is not None and not lora_rows and \
                run_native_stack(self.native_stack, h, positions, self, attn, meta, kv_caches):
            return self.norm(h) if keep_rows is None else self.norm(h[keep_rows])
        rope = self.rotary.for_step(positions, h.dtype, self.native)
        local: RotaryStep | None = None
        if self.local_rotary is not None:
            local = self.local_rotary.for_step(positions, h.dtype, self.native)
        delta = None
        last = len(self.layers) - 1
        per_layer = self.per_layer_inputs(input_ids, h) if self.config.per_layer_input_size else None
        embeds = h.clone() if self.shared_blocks is not None else None  # (the layers add to h in place)
        if self.altup_streams is not None:
            h = self.altup_streams.spread(h)
        # from the first of the layers that only read earlier layers' K/V on, the rows no one samples need nothing
        cut = last if keep_rows is None or self.rows_from is None else self.rows_from
        carried: torch.Tensor | None = None  # a shortcut MoE's output, for the next layer's delta
        if self.cycles is not None:
            h, streams = self.cycles.start(h)
        for i, layer in enumerate(self.layers):
            kv = kv_caches[self.cache_of[i]]
            if self.index_pool[i] is not None:
                kv = [kv, kv_caches[self.index_pool[i]]]
            step = local if self.uses_local[i] and local is not None else rope if self.rotates[i] else None
            shared = None
            if layer.shared_use is not None:
                assert self.shared_blocks is not None and embeds is not None
                shared = (self.shared_blocks[self.config.shared_block_of(i)], embeds)
            h, delta = layer(h, delta, step, attn, meta, kv, keep_rows if i >= cut else None,
                             None if per_layer is None else per_layer[:, i], shared=shared, reduced=i > cut)
            if i == cut and per_layer is not None and keep_rows is not None:
                per_layer = per_layer[keep_rows]
            if carried is not None and delta is not None:  # (cut to the sampled rows where this layer cut h)
                delta = delta + (carried if i != cut or keep_rows is None else carried[keep_rows])
            carried, layer.deferred = layer.deferred, None
            if self.cycles is not None:
                h, delta, streams = self.cycles.after(i, h, delta, streams)
        if self.altup_streams is not None:
            return self.norm(self.altup_streams.fold(h))
        return self.norm.add_forward(h, delta)

    def per_layer_inputs(self, input_ids: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """[T, layers, per_layer_input_size]: each token's own rows of the per-layer table (scaled by the square root
        of their width) and the normed projection of its embedding, averaged in the RMS sense (sum / sqrt(2))."""
        cfg = self.config
        layers, width = cfg.num_hidden_layers, cfg.per_layer_input_size
        # (ids past the table, Gemma 3n's multimodal tokens, read its row 0)
        ids = torch.where(input_ids < cfg.per_layer_vocab_size, input_ids, 0)
        own = self.per_layer_embed(ids).to(h.dtype) * torch.tensor(width ** 0.5, dtype=h.dtype)
        proj = self.per_layer_model_proj(h) * (cfg.hidden_size ** -0.5)
        proj = self.per_layer_proj_norm(proj.reshape(-1, width)).view(-1, layers, width)
        return (proj + own.view(-1, layers, width)) * (2.0 ** -0.5)

    @property
    def transforms_logits(self) -> bool:
        """Whether logits are scaled or capped after the LM head (Granite, Gemma 2), take its bias (Phi-2) or are
        padded past a pruned head (Apertus 1.5): then no head computes them in bf16 or draws the tokens itself."""
        cfg = self.config
        return cfg.logit_scale != 1 or cfg.final_logit_softcap is not None or cfg.lm_head_bias or \
            bool(cfg.output_vocab_size)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, keep_bf16: bool = False) -> torch.Tensor:
        """float32 logits [rows, vocab]. ``keep_bf16``: where the LM head computes in bf16 (an AMX
        GEMM, a bf16 model), its bf16 output as it is, without a conversion pass over the rows (the
        sampler's native draws read bf16: ``Sampler.reads_bf16``). Scaled and capped after the head
        where the architecture says (then always float32)."""
        keep_bf16 = keep_bf16 and not self.transforms_logits
        if self.lm_head is None:
            out = torch.nn.functional.linear(hidden, self.embed_tokens.weight)
        elif keep_bf16 and isinstance(self.lm_head, QuantLinear):
            out = self.lm_head(hidden, out_dtype=torch.bfloat16)  # bf16 on its AMX path; float32 otherwise
        else:
            out = self.lm_head(hidden)
        if keep_bf16 and out.dtype == torch.bfloat16:
            return out
        out = out.float()
        if self.config.logit_scale != 1:
            out = out * self.config.logit_scale
        if (cap := self.config.final_logit_softcap) is not None:
            out = torch.tanh(out / cap) * cap
        if out.shape[-1] < self.config.vocab_size:  # a pruned head: the input-only ids are never drawn
            out = torch.nn.functional.pad(out, (0, self.config.vocab_size - out.shape[-1]), value=float("-inf"))
        return out

    def draws_in_head(self, hidden: torch.Tensor) -> bool:
        """Whether ``draw_in_head`` takes these rows (a quantized LM head with its AMX tile copy, and
        rows in the range where it measured faster: ``QuantLinear.draws``; logits the head's as they are)."""
        return isinstance(self.lm_head, QuantLinear) and not self.transforms_logits and self.lm_head.draws(hidden)

    @torch.inference_mode()
    def draw_in_head(self, hidden: torch.Tensor, inv_temp: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """One token per row (int64), drawn inside the LM head without writing logits: greedy where
        ``inv_temp`` is 0, else from softmax(logits * inv_temp) with the row's uniform ``u``
        (``QuantLinear.draw``). Only where ``draws_in_head(hidden)``."""
        assert isinstance(self.lm_head, QuantLinear)
        return self.lm_head.draw(hidden, inv_temp, u)

    def has_amx_weights(self) -> bool:
        """Whether the quantized linears hold bf16 AMX copies (for many-row inputs)."""
        return any(m.amx is not None for m in self.modules() if isinstance(m, QuantLinear))

    @torch.inference_mode()
    def warm_up(self, max_rows: int, max_sampled_rows: int) -> int:
        """Runs zeros once through each distinct shape of the oneDNN AMX linears at every row count
        ``padded_rows`` hands them, AMX_MIN_ROWS (past a tile copy's rows) to ``max_rows`` (the LM
        head: to ``max_sampled_rows``).
        oneDNN compiles a kernel for each input shape on its first use (~3-5 ms here, ~1 MiB kept), which
        the first steps would otherwise pay on the way: ~5% of a first prefix-RAG wave. Returns the
        number of kernels. The shapes are bounded (``padded_rows``), so these are the kernels a running
        server compiles anyway."""
        linears: dict[tuple[int, int, int], QuantLinear] = {}
        for m in self.modules():
            if isinstance(m, QuantLinear) and m.amx is not None:
                limit = max_sampled_rows if m is self.lm_head else max_rows
                linears.setdefault((m.in_features, m.out_features, limit), m)
        done = 0
        for (k, _, limit), m in linears.items():
            assert m.amx is not None
            # rows up to m.tile_rows go to the tile kernel, which compiles nothing
            for rows in sorted({padded_rows(r) for r in range(max(AMX_MIN_ROWS, m.tile_rows + 1), limit + 1)}):
                m.amx(torch.zeros(rows, k, dtype=torch.bfloat16), dtype=torch.bfloat16)
                done += 1
        return done

    def quantization_tag(self) -> str:
        """The formats of the quantized layers, e.g. "q4_1,q8_0" (empty when all are dense)."""
        kinds = {m.kind for m in self.modules() if isinstance(m, QuantLinear)}
        kinds |= {m.weight_q.kind for m in self.modules() if isinstance(m, QuantEmbedding)}
        return ",".join(sorted(kinds))

    def weight_bytes(self) -> int:
        """Bytes the weights take in memory: parameters, buffers and every layer's own copies (packed,
        quantized, bf16 tiles), each storage counted once (a tied head shares the embedding's)."""
        seen: set[int] = set()
        total = 0
        for m in self.modules():
            tensors = [*m._parameters.values(), *m._buffers.values()]
            for v in vars(m).values():
                if isinstance(v, torch.Tensor):
                    tensors.append(v)
                elif isinstance(v, QuantWeight):
                    tensors += [v.qs, v.d, v.m]
            for t in tensors:
                if t is None or t.device.type == "meta":
                    continue
                try:
                    storage = t.untyped_storage()
                    key, size = storage.data_ptr(), storage.nbytes()
                except (RuntimeError, NotImplementedError):  # an opaque (mkldnn) tensor
                    key, size = id(t), t.numel() * t.element_size()
                if key not in seen:
                    seen.add(key)
                    total += size
        return total

    def pack_for_cpu(self) -> None:
        """Swap the linear layers (and the LM head, tied or not) for oneDNN-packed ones."""
        for m in self.modules():
            if isinstance(m, MoE):
                m.keep_gates()
        pack_linears(self)
        if self.lm_head is None:  # tied: the head gets its own packed copy of the embedding
            self.lm_head = PackedLinear(self.embed_tokens.weight, None)
