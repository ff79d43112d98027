"""Building a ``CausalLM`` over checkpoint weights: on the meta device, the quantized layers built over their
``QuantWeight``s, every other parameter copied from the tensors ``weight_sources`` names (stacked where
the model fuses them), cast, then packed for oneDNN and switched to the native ops where they run."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from kvserve.model.checkpoint import ReleasableWeights
from kvserve.model.config import ModelConfig
from kvserve.model.layers import LayerNorm, NarrowEmbedding, RMSNorm, cpu_packing_supported, unit_weights
from kvserve.model.quant import QuantWeight
from kvserve.model.quant_linear import QuantEmbedding, QuantLinear, quantized_modules
from kvserve.model.weight_layout import deinterleave_rotary, unstack_experts
from kvserve.model.weights import linear_sources, weight_sources

if TYPE_CHECKING:
    from kvserve.model.decoder import CausalLM


def build_model(cls: type["CausalLM"], cfg: ModelConfig, weights: dict[str, Any], dtype: torch.dtype,
                device: torch.device, quantization: str = "none", amx: bool | None = None) -> "CausalLM":
    """Build on the meta device, load, cast, and pack the linears for oneDNN where it helps (``amx``: whether
    quantized linears get bf16 AMX copies; None: where the CPU has AMX).

    ``weights`` may hold ``QuantWeight``s (a GGUF loaded with ``keep_quantized``); ``quantization``
    (see ``quantized_modules``) says which layers stay or become quantized, the rest is dequantized
    to ``dtype``. Experts stored stacked are cut into each expert's weights first (``unstack_experts``), and
    interleaved rotary's q/k rows reordered (``deinterleave_rotary``). ``ReleasableWeights`` lose each
    tensor as soon as the layers that read it are made (quantized or copied), so a start holds the
    checkpoint and the model at once only a tensor at a time.
    """
    handed = weights if isinstance(weights, ReleasableWeights) else None
    weights = deinterleave_rotary(cfg, unstack_experts(cfg, weights))

    def release(name: str) -> None:
        weights.pop(name, None)
        handed.pop(name, None)  # type: ignore[union-attr]

    quantized = quantized_modules(cfg, weights, quantization, device, release if handed is not None else None)
    sources = weight_sources(cfg)
    only_quantized = _used_only_by(quantized, cfg, sources)
    weights = {k: v.dequantize() if isinstance(v, QuantWeight) else v for k, v in weights.items()
               if not (isinstance(v, QuantWeight) and k in only_quantized)}
    narrow = _narrow_embedding(cfg, weights, quantized, dtype)
    # the per-layer inputs' table (Gemma 4: layers x 256 values a token) only ever looked up: kept as stored too
    per_layer = weights.get(PER_LAYER_TABLE) if cfg.per_layer_input_size else None
    narrow_per_layer = _narrow_table(per_layer, dtype)
    with torch.device("meta"):
        model = cls(cfg)
        for path in quantized:  # no dense storage for these: they are built below
            _set_module(model, path, nn.Identity())
        if narrow is not None:
            _set_module(model, "embed_tokens", nn.Identity())
        if narrow_per_layer is not None:
            _set_module(model, "per_layer_embed", nn.Identity())
    # allocated in the final dtype: copying in casts, and no float32 model is held on the way
    model = model.to(dtype).to_empty(device=device)
    load_weights(model, cfg, weights, sources, release if handed is not None else None)
    unit_weights(model)
    model = model.eval()
    model.rotary.to(device)
    if model.local_rotary is not None:
        model.local_rotary.to(device)
    if narrow is not None:
        _set_module(model, "embed_tokens", NarrowEmbedding(narrow, dtype))
        if handed is not None:  # no parameter read it, so load_weights did not release it
            release("model.embed_tokens.weight")
    if narrow_per_layer is not None:
        _set_module(model, "per_layer_embed", NarrowEmbedding(narrow_per_layer, dtype))
        if handed is not None:
            release(PER_LAYER_TABLE)
    while quantized:  # each QuantWeight dropped once its layer holds the packed form
        path, qw = quantized.popitem()
        if path == "embed_tokens":
            _set_module(model, path, QuantEmbedding(qw, dtype))
        else:
            bias = _stacked(weights, sources.get(path + ".bias"))
            _set_module(model, path, QuantLinear(qw, bias, dtype, amx=amx, tiles=path != "lm_head", head=path == "lm_head"))
    if device.type == "cpu" and cpu_packing_supported(dtype):
        model.pack_for_cpu()
    if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16):
        from kvserve.kernels import load_kernels

        model.use_native_ops(load_kernels())
    return model


def load_weights(model: nn.Module, cfg: ModelConfig, weights: dict[str, torch.Tensor],
                 sources: dict[str, list[tuple[str, tuple[int, ...]]]],
                 release: Callable[[str], None] | None = None) -> None:
    """Copy checkpoint tensors into ``model``'s parameters by ``sources`` (``weight_sources``: q/k/v and
    gate/up stacked into single GEMMs). Parameters a quantized layer holds instead are not there.
    ``release(name)`` is called for each checkpoint tensor once the last parameter made from it is loaded."""
    own = dict(model.named_parameters())
    sources = dict(sources)
    if cfg.tie_word_embeddings is False and "lm_head.weight" not in weights:
        sources["lm_head.weight"] = sources["embed_tokens.weight"]  # a checkpoint that ties without saying so
    readers: dict[str, int] = {}
    for name in own:
        for source, _ in sources.get(name, []):
            readers[source] = readers.get(source, 0) + 1
    offset = {name for name, m in model.named_modules() if isinstance(m, (RMSNorm, LayerNorm))} if cfg.norm_offset \
        else set()
    for name, p in own.items():
        if name not in sources:
            raise ValueError(f"{name}: no checkpoint tensor is mapped to it")
        tensor = _stacked(weights, sources[name])
        if tensor is None:
            raise ValueError(f"weights missing from the checkpoint: {[n for n, _ in sources[name] if n not in weights][:5]}")
        if p.shape != tensor.shape:
            raise ValueError(f"{name}: expected shape {tuple(p.shape)}, file has {tuple(tensor.shape)}")
        if name.endswith(".weight") and name.removesuffix(".weight") in offset:  # Gemma's norms (Nemotron's
            # LayerNorms) scale by 1 + weight: stored as such
            tensor = tensor.float() + cfg.norm_offset
        with torch.no_grad():
            p.copy_(tensor)
        del tensor
        for source, _ in sources[name]:
            readers[source] -= 1
            if release is not None and readers[source] == 0:
                release(source)


def _stacked(weights: dict[str, Any], sources: list[tuple[str, tuple[int, ...]]] | None) -> torch.Tensor | None:
    if not sources or any(n not in weights for n, _ in sources):
        return None
    parts = [weights[n] for n, _ in sources]
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _used_only_by(quantized: dict[str, QuantWeight], cfg: ModelConfig,
                  sources: dict[str, list[tuple[str, tuple[int, ...]]]]) -> set[str]:
    """The checkpoint weights only quantized layers use (so they need not be dequantized)."""
    users: dict[str, list[str]] = {}
    for path, names in linear_sources(cfg, sources).items():
        for name in names:
            users.setdefault(name, []).append(path)
    out = {name for name, paths in users.items() if all(p in quantized for p in paths)}
    if "embed_tokens" in quantized and not _head_reads_embedding(cfg, quantized):
        out.add("model.embed_tokens.weight")
    if "lm_head" in quantized:
        out.add("lm_head.weight")
    return out


def _head_reads_embedding(cfg: ModelConfig, quantized: dict[str, QuantWeight]) -> bool:
    """Whether the LM head is the embedding table itself: tied, and not built as its own quantized layer."""
    return cfg.tie_word_embeddings is not False and "lm_head" not in quantized


def _narrow_embedding(cfg: ModelConfig, weights: dict[str, Any], quantized: dict[str, QuantWeight],
                      dtype: torch.dtype) -> torch.Tensor | None:
    """The checkpoint's embedding table, to keep as it is stored, where it is a float dtype narrower than
    the model's and only lookups read it (the LM head is its own layer: quantized, or untied). A float32
    model of a bf16 checkpoint (the integer kernels' dtype) would otherwise hold a table of 2 GiB at 8B
    for one row a token."""
    if "embed_tokens" in quantized or _head_reads_embedding(cfg, quantized):
        return None
    return _narrow_table(weights.get("model.embed_tokens.weight"), dtype)


PER_LAYER_TABLE = "model.embed_tokens_per_layer.weight"


def _narrow_table(table: Any, dtype: torch.dtype) -> torch.Tensor | None:
    """A copy of a lookup table stored in a float dtype narrower than ``dtype`` (else None: built as the model's)."""
    if not isinstance(table, torch.Tensor) or not table.is_floating_point() or table.element_size() >= dtype.itemsize:
        return None
    return table.detach().clone()  # its own memory: the checkpoint's (an mmap) is released


def _set_module(model: nn.Module, path: str, module: nn.Module) -> None:
    """``model.<path> = module``; unlike ``set_submodule`` it may replace a None (a tied LM head)."""
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, module)

