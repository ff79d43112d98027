"""The Llama-family decoder (Llama 2/3, SmolLM, Mistral-style GQA, Qwen2 with q/k/v bias)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvserve.attention import AttentionBackend, AttentionMetadata
from kvserve.model.config import ModelConfig
from kvserve.model.native_stack import build_native_stack, run_native_stack
from kvserve.model.layers import (PackedLinear, RMSNorm, Rotary, RotaryStep, SwiGLU, pack_linears, padded_rows,
                                  runs_amx)
from kvserve.model.quant import QuantWeight
from kvserve.model.quant_linear import (AMX_MIN_ROWS, QuantEmbedding, QuantLinear, fused_linear_sources,
                                       quantized_modules)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.hidden_size = cfg.hidden_size
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.qkv = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=False)

    def runs_bf16(self, x: torch.Tensor, attn: AttentionBackend, meta: AttentionMetadata,
                  kv_cache: tuple[torch.Tensor, torch.Tensor]) -> bool:
        """Whether q/k/v stay bf16 from the GEMM through rotary, the KV write and attention into o_proj:
        where the GEMM runs in bf16 and attention and the KV cache are bf16 anyway (AMX prefill), which
        saves the float32 round trips (~4% of a prefill). Steps the native decode stack could run keep
        its float32 arithmetic."""
        return (attn.prefill_dtype == torch.bfloat16 and kv_cache[0].dtype == torch.bfloat16
                and runs_amx(self.qkv, x) and attn.native_step(meta) is None)

    def forward(self, x, rope: RotaryStep, attn: AttentionBackend, meta: AttentionMetadata,
                kv_cache: tuple[torch.Tensor, torch.Tensor], bf16: bool = False, rows: torch.Tensor | None = None,
                tokens: int | None = None):
        """``bf16`` (see ``runs_bf16``): x is the bf16 input of the qkv GEMM and the output is bf16.
        ``rows``: every row's K/V is written but only these attend: the output is theirs.
        ``tokens``: the step's rows, where x has zero rows past them (the GEMM's padding)."""
        t = x.shape[0] if tokens is None else tokens
        qkv = (self.qkv(x, out_dtype=torch.bfloat16) if bf16 else self.qkv(x))[:t]
        q, k, v = qkv.split(self.split, dim=-1)
        q, k = rope.apply(q.view(t, self.num_heads, self.head_dim), k.view(t, self.num_kv_heads, self.head_dim))
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if rows is None:
            o = attn.forward(q, k, v, kv_cache, meta)
        else:
            o = attn.forward_rows(q, k, v, kv_cache, meta, rows)
        if not o.shape[0]:  # no row attends (a step that samples nothing): the K/V writes were all
            return x.new_empty(0, self.hidden_size)
        o = o.reshape(o.shape[0], -1)
        return self.o_proj(o, out_dtype=torch.bfloat16) if bf16 else self.o_proj(o)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, h, delta, rope, attn, meta, kv_cache,
                rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Adds ``delta`` (the previous layer's MLP output, or None) to the residual stream ``h`` in
        place, then this layer's attention output; returns the stream and this layer's MLP output, for
        the next layer's norm (or the final one) to add in the same pass as its own.

        ``rows`` (the last layer, when the caller reads only the rows it samples): every row's K/V is
        written, but attention, the MLP and the returned stream are those rows' only.

        On an AMX step the norms write bf16 (what the GEMMs read) and the GEMMs' bf16 outputs go
        into the float32 residual as they are: no conversion passes between them."""
        t = h.shape[0]
        bf16_attn = self.self_attn.runs_bf16(h, attn, meta, kv_cache)
        # the norms write the bf16 GEMMs' inputs already padded to the rows oneDNN gets (padded_rows)
        x = self.input_layernorm.add_forward(h, delta, *((torch.bfloat16, padded_rows(t)) if bf16_attn else ()))
        x = self.self_attn(x, rope, attn, meta, kv_cache, bf16_attn, rows, t)
        if rows is not None:
            h = h[rows]
            if not rows.numel():
                return h, None
        bf16_mlp = self.mlp.native and runs_amx(self.mlp.gate_up, h)
        x = self.post_attention_layernorm.add_forward(h, x, *((torch.bfloat16, padded_rows(h.shape[0])) if bf16_mlp else ()))
        return h, self.mlp(x)[: h.shape[0]]


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.native = False
        self.native_stack: Any | None = None  # every layer in one native call (kvserve.model.native_stack)

    @classmethod
    def from_hf_weights(cls, cfg: ModelConfig, weights: dict[str, Any], dtype: torch.dtype,
                        device: torch.device, quantization: str = "none") -> "LlamaForCausalLM":
        """Build on the meta device, load, cast, and pack the linears for oneDNN where it helps.

        ``weights`` may hold ``QuantWeight``s (a GGUF loaded with ``keep_quantized``);
        ``quantization`` (see ``quantized_modules``) says which layers stay or become quantized,
        the rest is dequantized to ``dtype``.
        """
        from kvserve.model.layers import cpu_packing_supported

        quantized = quantized_modules(cfg, weights, quantization, device)
        weights = {k: v.dequantize() if isinstance(v, QuantWeight) else v for k, v in weights.items()
                   if not (isinstance(v, QuantWeight) and _only_in(k, quantized, cfg))}
        with torch.device("meta"):
            model = cls(cfg)
            for path in quantized:  # no dense storage for these: they are built below
                _set_module(model, path, nn.Identity())
        # allocated in the final dtype: copying in casts, and no float32 model is held on the way
        model = model.to(dtype).to_empty(device=device)
        model.load_hf_weights(weights)
        model = model.eval()
        model.rotary.to(device)
        for path, qw in quantized.items():
            if path == "embed_tokens":
                _set_module(model, path, QuantEmbedding(qw, dtype))
            else:
                bias = _fused_bias(cfg, weights, path)
                _set_module(model, path, QuantLinear(qw, bias, dtype, tiles=path != "lm_head", head=path == "lm_head"))
        if device.type == "cpu" and cpu_packing_supported(dtype):
            model.pack_for_cpu()
        if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16):
            from kvserve.kernels import load_kernels

            model.use_native_ops(load_kernels())
        return model

    def use_native_ops(self, on: bool = True) -> None:
        """Norms, rotary and the MLP's activation through the fused CPU kernels (kvserve.kernels)."""
        self.native = on
        for m in self.modules():
            if isinstance(m, (RMSNorm, SwiGLU)):
                m.native = on
        self.native_stack = build_native_stack(self) if on else None

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
        if self.native_stack is not None and run_native_stack(self.native_stack, h, positions, self, attn, meta, kv_caches):
            return self.norm(h) if keep_rows is None else self.norm(h[keep_rows])
        rope = self.rotary.for_step(positions, h.dtype, self.native)
        delta = None
        last = len(self.layers) - 1
        for i, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
            h, delta = layer(h, delta, rope, attn, meta, kv, keep_rows if i == last else None)
        return self.norm.add_forward(h, delta)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, keep_bf16: bool = False) -> torch.Tensor:
        """float32 logits [rows, vocab]. ``keep_bf16``: where the LM head computes in bf16 (an AMX
        GEMM, a bf16 model), its bf16 output as it is, without a conversion pass over the rows (the
        sampler's native draws read bf16: ``Sampler.reads_bf16``)."""
        if self.lm_head is None:
            out = torch.nn.functional.linear(hidden, self.embed_tokens.weight)
        elif keep_bf16 and isinstance(self.lm_head, QuantLinear):
            out = self.lm_head(hidden, out_dtype=torch.bfloat16)  # bf16 on its AMX path; float32 otherwise
        else:
            out = self.lm_head(hidden)
        return out if keep_bf16 and out.dtype == torch.bfloat16 else out.float()

    def draws_in_head(self, hidden: torch.Tensor) -> bool:
        """Whether ``draw_in_head`` takes these rows (a quantized LM head with its AMX tile copy, and
        rows in the range where it measured faster: ``QuantLinear.draws``)."""
        return isinstance(self.lm_head, QuantLinear) and self.lm_head.draws(hidden)

    @torch.inference_mode()
    def draw_in_head(self, hidden: torch.Tensor, inv_temp: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """One token per row (int64), drawn inside the LM head without writing logits: greedy where
        ``inv_temp`` is 0, else from softmax(logits * inv_temp) with the row's uniform ``u``
        (``QuantLinear.draw``). Only where ``draws_in_head(hidden)``."""
        assert isinstance(self.lm_head, QuantLinear)
        return self.lm_head.draw(hidden, inv_temp, u)

    def runs_amx(self) -> bool:
        """Whether the quantized linears run many-row inputs through their bf16 AMX copies."""
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

    def pack_for_cpu(self) -> None:
        """Swap the linear layers (and the LM head, tied or not) for oneDNN-packed ones."""
        pack_linears(self)
        if self.lm_head is None:  # tied: the head gets its own packed copy of the embedding
            self.lm_head = PackedLinear(self.embed_tokens.weight, None)

    def load_hf_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy Hugging Face-named tensors in, fusing q/k/v and gate/up into single GEMMs."""
        own = dict(self.named_parameters())
        done: set[str] = set()

        def put(name: str, *parts: torch.Tensor) -> None:
            if name not in own:  # a quantized layer holds this weight (see from_hf_weights)
                return
            tensor = torch.cat(parts) if len(parts) > 1 else parts[0]
            p = own[name]
            if p.shape != tensor.shape:
                raise ValueError(f"{name}: expected shape {tuple(p.shape)}, file has {tuple(tensor.shape)}")
            with torch.no_grad():
                p.copy_(tensor)
            done.add(name)

        put("embed_tokens.weight", weights.get("model.embed_tokens.weight"))
        put("norm.weight", weights["model.norm.weight"])
        if self.lm_head is not None:
            put("lm_head.weight", weights.get("lm_head.weight", weights.get("model.embed_tokens.weight")))
        for i in range(self.config.num_hidden_layers):
            src, dst = f"model.layers.{i}.", f"layers.{i}."
            put(dst + "input_layernorm.weight", weights[src + "input_layernorm.weight"])
            put(dst + "post_attention_layernorm.weight", weights[src + "post_attention_layernorm.weight"])
            attn = src + "self_attn."
            put(dst + "self_attn.qkv.weight", *[weights.get(attn + f"{p}_proj.weight") for p in "qkv"])
            if self.config.attention_bias:
                put(dst + "self_attn.qkv.bias", *[weights[attn + f"{p}_proj.bias"] for p in "qkv"])
            put(dst + "self_attn.o_proj.weight", weights.get(attn + "o_proj.weight"))
            mlp = src + "mlp."
            put(dst + "mlp.gate_up.weight", weights.get(mlp + "gate_proj.weight"), weights.get(mlp + "up_proj.weight"))
            put(dst + "mlp.down.weight", weights.get(mlp + "down_proj.weight"))
        missing = set(own) - done
        if missing:
            raise ValueError(f"weights missing from the checkpoint: {sorted(missing)[:5]}")


def _only_in(name: str, quantized: dict[str, QuantWeight], cfg: ModelConfig) -> bool:
    """Whether weight ``name`` is used only by quantized layers (so it need not be dequantized)."""
    users = [path for path, names in fused_linear_sources(cfg).items() if name in names]
    if name == "model.embed_tokens.weight":
        return "embed_tokens" in quantized and (cfg.tie_word_embeddings is False or "lm_head" in quantized)
    if name == "lm_head.weight":
        return "lm_head" in quantized
    return bool(users) and all(u in quantized for u in users)


def _fused_bias(cfg: ModelConfig, weights: dict[str, Any], path: str) -> torch.Tensor | None:
    if path.endswith("self_attn.qkv") and cfg.attention_bias:
        prefix = "model." + path.removesuffix("qkv")
        return torch.cat([weights[prefix + f"{p}_proj.bias"] for p in "qkv"])
    return None


def _set_module(model: nn.Module, path: str, module: nn.Module) -> None:
    """``model.<path> = module``; unlike ``set_submodule`` it may replace a None (a tied LM head)."""
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, module)
