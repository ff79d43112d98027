"""Loading a GGUF file: metadata -> ``ModelConfig``, tensors -> torch weights, and its tokenizer.

Tensors of type F32/F16/BF16/Q8_0/Q4_0/Q4_1/Q4_K/Q6_K/MXFP4 are dequantized to float32 at load (or,
asked to, Q8_0/Q4_0/Q4_1/Q4_K ones are kept quantized as ``QuantWeight``s, and MXFP4 ones as the q8_0
holding the same values) and renamed to the names the
architecture's Hugging Face checkpoints use (its metadata goes through the same config parse as a
config.json). What llama.cpp's converter changes is undone, so a GGUF file gives the same layout as a
Hugging Face folder: the rotary reordering of q/k rows (its Llama lineage: "llama", "granite", "smollm3"), the experts stacked one tensor a
layer (split per expert, quantized ones too; gate and up fused or not; stacked again as gpt-oss's
checkpoints hold them: ``weight_layout.stack_experts``; a shared expert's gate and up likewise where they are one tensor), the norms stored with Gemma's + 1. The tokenizer is the one transformers builds from the GGUF metadata.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import gguf
import gguf.quants
import numpy as np
import torch

from kvserve.errors import ModelLoadError
from kvserve.model.architectures import Architecture, get_architecture, gguf_architectures
from kvserve.model.checkpoint import LoadedModel
from kvserve.model.config import ModelConfig
from kvserve.model.gguf_names import GGUF_FUSED_GATE_UP, gguf_to_hf_name
from kvserve.model.gguf_reader import fast_gguf_reader, gguf_metadata
from kvserve.model.quant import QuantWeight, from_gguf_blocks
from kvserve.model.weight_layout import (gates_after_q, join_latent_kv, stack_dense_gate_up, stack_experts,
                                         stack_shared_gate_up)

logger = logging.getLogger(__name__)



_QT = gguf.GGMLQuantizationType
SUPPORTED_GGUF_TYPES = frozenset({_QT.F32, _QT.F16, _QT.BF16, _QT.Q8_0, _QT.Q4_0, _QT.Q4_1, _QT.Q4_K, _QT.Q6_K,
                                  _QT.MXFP4})


def dequantize_gguf_tensor(tensor: gguf.ReaderTensor) -> np.ndarray:
    """One GGUF tensor as a writable float32 array in numpy (= Hugging Face) shape."""
    if tensor.tensor_type not in SUPPORTED_GGUF_TYPES:
        supported = ", ".join(sorted(t.name for t in SUPPORTED_GGUF_TYPES))
        raise ModelLoadError(
            f"GGUF tensor {tensor.name} has type {tensor.tensor_type.name}, which kvserve cannot read "
            f"(supported: {supported})"
        )
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    # GGUF lists dimensions fastest-first; numpy wants them slowest-first.
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    # F32 comes back as a read-only view of the file mapping: copy it so nothing keeps the file mapped.
    return np.require(values.reshape(shape), dtype=np.float32, requirements=["C", "W"])


KEPT_QUANTIZED = frozenset({_QT.Q8_0, _QT.Q4_0, _QT.Q4_1, _QT.Q4_K, _QT.MXFP4})  # MXFP4 as q8_0: the same values


def _quant_weight(tensor: gguf.ReaderTensor, heads: int | None) -> QuantWeight:
    """A Q8_0/Q4_0/Q4_1/Q4_K/MXFP4 tensor as a QuantWeight (ValueError: MXFP4 scales q8_0 cannot hold), its q/k rows un-permuted like the dense ones."""
    shape = (int(tensor.shape[1]), int(tensor.shape[0]))  # GGUF lists dimensions fastest-first
    qw = from_gguf_blocks(tensor.data, tensor.tensor_type.name, shape)
    if heads is not None:
        order = unpermute_rotary_rows(np.arange(shape[0]), heads)  # where each output row comes from
        qw = qw.rows(torch.from_numpy(order))
    return qw


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of q/k projection rows (and biases) for its rotary kernel.

    HF's Llama rotates the two halves of each head ([x0..x(d/2-1)] with [x(d/2)..x(d-1)]); GGML's
    "normal" rope rotates adjacent pairs, so llama.cpp's converter stores head rows as
    (half, pair) -> (pair, half). Reversing that is the same reshape with the two axes swapped back,
    exactly as transformers' GGUF loader does.
    """
    rows = weight.shape[0]
    pairs = rows // num_heads // 2
    grouped = weight.reshape(num_heads, pairs, 2, *weight.shape[1:])
    return np.ascontiguousarray(grouped.swapaxes(1, 2)).reshape(weight.shape)


def _gguf_config(meta: dict[str, Any], tensors: dict[str, Any], source: Path) -> ModelConfig:
    arch = meta.get("general.architecture")
    known = gguf_architectures()
    if arch not in known:
        raise ModelLoadError(f"{source}: GGUF architecture {arch!r} is not supported (only {', '.join(known)})")

    get = _FileView(meta, arch, tensors)
    try:
        hidden = int(get("embedding_length"))
        heads = int(get("attention.head_count")) or 1  # (0 in llama.cpp's mamba files: no layer attends)
        layers = int(get("block_count"))
        intermediate = get("feed_forward_length")  # a list: per layer (the architecture reads which from it)
        intermediate = int(intermediate[0] if isinstance(intermediate, list) else intermediate)
    except TypeError as e:  # int(None): a required key is absent
        raise ModelLoadError(f"{source}: GGUF metadata lacks a required {arch}.* key") from e
    kv_heads = get("attention.head_count_kv", heads)
    # a list: per layer (LFM2's, 0 where a layer does not attend); the architecture reads which layers from it
    kv_heads = (max(kv_heads) if isinstance(kv_heads, list) else int(kv_heads)) or heads
    spec = get_architecture(known[arch])
    head_dim = get("attention.key_length")
    if head_dim is None and spec.gguf_permuted:
        head_dim = get("rope.dimension_count")  # Llama's converter writes the whole head's (transformers reads it so)
    head_dim = int(head_dim) if head_dim is not None else hidden // heads

    vocab = int(meta.get("tokenizer.ggml.tokens") or get("vocab_size", 0))
    embed = tensors.get("token_embd.weight")
    if embed is not None and int(embed.shape[-1]) != vocab:
        # The embedding's row count is what the weights need, e.g. a vocabulary padded for speed.
        vocab = int(embed.shape[-1])

    eos_ids = [
        int(meta[key])
        for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        if meta.get(key) is not None
    ]
    bos = meta.get("tokenizer.ggml.bos_token_id")
    # the config.json this file's model would have: then the one parse, the architecture's options included
    hf = {"architectures": [known[arch]], "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": intermediate,
          "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
          "head_dim": head_dim, "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
          "rope_theta": float(get("rope.freq_base", 10000.0)), "rope_scaling": _rope_scaling(get, tensors, source),
          "max_position_embeddings": int(get("context_length", 4096)),
          "tie_word_embeddings": "output.weight" not in tensors, "bos_token_id": None if bos is None else int(bos),
          "eos_token_id": list(dict.fromkeys(eos_ids)),
          # llama.cpp's keys of the layer options (0: none), which the architectures that have them read
          "sliding_window": get("attention.sliding_window") or None,
          "attn_logit_softcapping": get("attn_logit_softcapping") or None,
          "final_logit_softcapping": get("final_logit_softcapping") or None,
          "rope_local_base_freq": get("rope.freq_base_swa"),
          # llama.cpp's graphs with a parallel form (stablelm) take it where a layer has no norm before the MLP
          "use_parallel_residual": "blk.0.ffn_norm.weight" not in tensors}
    experts = int(get("expert_count", 0))
    if experts:
        hf.update(num_experts=experts, num_local_experts=experts, num_experts_per_tok=int(get("expert_used_count", 0)),
                  moe_intermediate_size=int(get("expert_feed_forward_length", intermediate)),
                  shared_expert_intermediate_size=int(get("expert_shared_feed_forward_length", 0)))
    own = spec.gguf_config(get)
    # options of the scaling the file names (none: nothing to add to), or a scaling of the architecture's own
    if isinstance(own.get("rope_scaling"), dict) and "rope_type" not in own["rope_scaling"]:
        own["rope_scaling"] = {**hf["rope_scaling"], **own["rope_scaling"]} if hf["rope_scaling"] else None
    hf.update(own)
    try:
        config = ModelConfig.from_hf_dict(hf)
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{source}: unusable GGUF metadata ({type(e).__name__}: {e})") from e
    # the file's tensors say which linears have biases, whatever the architecture's config keys (use_bias, ...),
    # in any layer (the first may be a MoE layer, a dense MLP's bias further down)
    biased = {n.split(".")[2] for n in tensors if n.startswith("blk.") and n.endswith(".bias") and n.count(".") == 3}
    config.attention_bias = bool(biased & {"attn_q", "attn_qkv"})
    config.o_proj_bias = "attn_output" in biased
    config.mlp_bias = bool(biased & {"ffn_up", "ffn_down"})
    config.lm_head_bias = "output.bias" in tensors
    return config


class _FileView:
    """A GGUF file's metadata and tensors as an architecture's ``gguf_config`` reads them (``GGUFGet``)."""

    def __init__(self, meta: dict[str, Any], arch: str, tensors: dict[str, Any]) -> None:
        self._meta, self._arch, self._tensors = meta, arch, tensors

    def __call__(self, key: str, default: Any = None) -> Any:
        value = self._meta.get(f"{self._arch}.{key}", default)
        return default if value is None else value

    def has(self, name: str) -> bool:
        return name in self._tensors

    def values(self, name: str) -> list[float]:
        return dequantize_gguf_tensor(self._tensors[name]).reshape(-1).tolist()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(n) for n in reversed(self._tensors[name].shape.tolist()))  # GGUF lists them fastest-first


def _rope_scaling(get: Any, tensors: dict[str, Any], source: Path) -> dict[str, Any] | None:
    """HF's rope_scaling dict from llama.cpp's keys (linear, yarn), or longrope's factor tensors (Phi-3)."""
    original = get("rope.scaling.original_context_length")
    if "rope_factors_long.weight" in tensors and "rope_factors_short.weight" in tensors:
        scaling = {"rope_type": "longrope", "original_max_position_embeddings": original and int(original),
                   "long_factor": dequantize_gguf_tensor(tensors["rope_factors_long.weight"]).tolist(),
                   "short_factor": dequantize_gguf_tensor(tensors["rope_factors_short.weight"]).tolist()}
        if get("rope.scaling.attn_factor") is not None:
            scaling["attention_factor"] = float(get("rope.scaling.attn_factor"))
        return scaling
    if "rope_freqs.weight" in tensors:
        # llama.cpp's converter writes Llama 3's scaling as each rotary pair's frequency divisor; ggml's rope divides
        # by them, and so do we (an architecture whose scaling the factors encode says so in its gguf_config)
        return {"rope_type": "freq_factors",
                "freq_factors": dequantize_gguf_tensor(tensors["rope_freqs.weight"]).tolist()}
    scaling_type = get("rope.scaling.type")
    factor = get("rope.scaling.factor") or get("rope.scale_linear")
    if scaling_type in (None, "none") and not (scaling_type is None and factor):
        return None
    scaling: dict[str, Any] = {"rope_type": scaling_type or "linear", "factor": float(factor or 1.0)}
    if original:
        scaling["original_max_position_embeddings"] = int(original)
    for key in ("beta_fast", "beta_slow"):  # yarn's, where the converter wrote them (else HF's defaults, 32 and 1)
        if get(f"rope.scaling.yarn_{key}") is not None:
            scaling[key] = float(get(f"rope.scaling.yarn_{key}"))
    return scaling


def gguf_config(path: Path) -> ModelConfig:
    """Only the ``ModelConfig`` of a GGUF file (metadata, tensor shapes and longrope's small factor
    tensors; no weight is read)."""
    reader = fast_gguf_reader(path)
    return _gguf_config(gguf_metadata(reader), {t.name: t for t in reader.tensors}, path)


def load_gguf(path: Path, keep_quantized: bool = False, with_tokenizer: bool = True) -> LoadedModel:
    """Config, weights and tokenizer of a GGUF file (weights not yet checked).

    Weights are dense float32, except with ``keep_quantized``: then 2-D Q8_0/Q4_0/Q4_1/Q4_K/MXFP4 tensors
    (and each expert's slice of 3-D ones) come as ``QuantWeight`` (Q4_0 and Q4_K as the equivalent
    Q4_1, MXFP4 as Q8_0), as the file stores them.
    """
    reader = fast_gguf_reader(path)
    meta = gguf_metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    config = _gguf_config(meta, tensors, path)

    # Only llama.cpp's LlamaModel lineage permutes q/k; the others are converted for NEOX-style rope as is.
    permuted = get_architecture(gguf_architectures()[meta["general.architecture"]]).gguf_permuted
    arch = get_architecture(config.architecture)
    weights: dict[str, Any] = {}
    for name, tensor in tensors.items():
        if f".{GGUF_FUSED_GATE_UP}." in name:
            weights.update(_fused_gate_up(name, tensor, arch, keep_quantized, path))
            continue
        hf_name = gguf_to_hf_name(name, arch)
        if hf_name is None:
            logger.debug("%s: skipping tensor %s", path, name)
            continue
        if "{e}" in hf_name:
            for e, w in enumerate(_split_experts(tensor, keep_quantized, path)):
                weights[hf_name.format(e=e)] = w
            continue
        heads = None
        if permuted and ".attn_q." in name:
            heads = config.num_attention_heads
        elif permuted and ".attn_k." in name:
            heads = config.num_key_value_heads
        if keep_quantized and tensor.tensor_type in KEPT_QUANTIZED and len(tensor.shape) == 2:
            try:
                weights[hf_name] = _quant_weight(tensor, heads)
                continue
            except ValueError as e:  # MXFP4 scales q8_0's fp16 cannot hold: dequantized below
                logger.warning("%s: %s stays dequantized: %s", path, name, e)
        _log_dequantized(tensor, keep_quantized, path)
        values = dequantize_gguf_tensor(tensor)
        if heads is not None:
            values = unpermute_rotary_rows(values, heads)
        if config.norm_offset and name.endswith("norm.weight") and not name.endswith(".ssm_norm.weight"):
            # llama.cpp stores Gemma's, Nemotron's and Qwen3.5's norms with the 1 added (not the delta nets' gated
            # norm: it scales by its weight); we add it
            values -= config.norm_offset
        if name.endswith(".ffn_gate_inp_shexp.weight") and values.ndim == 1:
            values = values[None]  # older converters squeezed the shared expert's gate [1, hidden] to [hidden]
        if name.endswith(".ssm_norm.weight") or name.endswith((".ssm_a", ".ssm_d")) and values.shape[-1] == 1:
            values = values.reshape(-1)  # Mamba-2's, stored [groups, n] / [heads, 1] (Mamba-1's A is [inner, state])
        if name.endswith(".ssm_a"):  # stored as A = -exp(A_log)
            values = np.log(-values)
        weights[hf_name] = torch.from_numpy(values)
    del reader, tensors  # drop the file mapping
    weights = join_latent_kv(config, stack_shared_gate_up(config, stack_experts(config, weights)))
    weights = stack_dense_gate_up(config, weights)
    if arch.gguf_weights is not None:
        weights = arch.gguf_weights(config, weights)
    if config.attn_output_gate:  # llama.cpp keeps gated attention's q_proj as the checkpoints store it
        for i in range(config.num_hidden_layers):
            if not config.is_recurrent(i):
                gates_after_q(config, weights, f"model.layers.{i}.{arch.weight_name('q_proj')}")

    if arch.adjust_weights is not None:  # the checkpoint's tensors again: what the architecture folds in at load
        weights = arch.adjust_weights(config, weights)
    tokenizer = gguf_tokenizer(path, meta.get("tokenizer.chat_template")) if with_tokenizer else None
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer, name=path.stem)


def _split_experts(tensor: gguf.ReaderTensor, keep_quantized: bool, path: Path) -> list[Any]:
    """A layer's experts stacked in one tensor (numpy shape [experts, rows, cols]) as one weight each:
    row slices of one QuantWeight where it stays quantized, else views of the dense array; their biases
    ([experts, rows]) one row each."""
    if len(tensor.shape) == 2 and tensor.name.endswith(".bias"):
        return list(torch.from_numpy(dequantize_gguf_tensor(tensor)).unbind(0))
    if len(tensor.shape) != 3:
        raise ModelLoadError(f"{path}: {tensor.name} should stack the experts in 3 dimensions, has {len(tensor.shape)}")
    cols, rows, experts = (int(n) for n in tensor.shape)  # GGUF lists dimensions fastest-first
    if keep_quantized and tensor.tensor_type in KEPT_QUANTIZED:
        try:
            qw = from_gguf_blocks(tensor.data, tensor.tensor_type.name, (experts * rows, cols))
            return [qw.rows(slice(e * rows, (e + 1) * rows)) for e in range(experts)]
        except ValueError as e:  # MXFP4 scales q8_0's fp16 cannot hold
            logger.warning("%s: %s stays dequantized: %s", path, tensor.name, e)
    _log_dequantized(tensor, keep_quantized, path)
    return list(torch.from_numpy(dequantize_gguf_tensor(tensor)).unbind(0))


def _fused_gate_up(name: str, tensor: gguf.ReaderTensor, arch: Architecture, keep_quantized: bool,
                   path: Path) -> dict[str, Any]:
    """Each expert's gate and up weights from a fused ``ffn_gate_up_exps`` tensor (gate rows first)."""
    gate, up = (gguf_to_hf_name(name.replace(GGUF_FUSED_GATE_UP, part), arch)
                for part in ("ffn_gate_exps", "ffn_up_exps"))
    out: dict[str, Any] = {}
    for e, w in enumerate(_split_experts(tensor, keep_quantized, path)):
        half = w.shape[0] // 2
        for hf_name, rows in ((gate, slice(0, half)), (up, slice(half, None))):
            out[str(hf_name).format(e=e)] = w.rows(rows) if isinstance(w, QuantWeight) else w[rows]
    return out


def _log_dequantized(tensor: gguf.ReaderTensor, keep_quantized: bool, path: Path) -> None:
    if keep_quantized and tensor.tensor_type not in (_QT.F32, _QT.F16, _QT.BF16) and len(tensor.shape) >= 2:
        logger.info("%s: %s is %s, which stays dequantized (kept quantized: Q8_0, Q4_0, Q4_1, Q4_K; MXFP4 as Q8_0)",
                    path, tensor.name, tensor.tensor_type.name)


def gguf_tokenizer(path: Path, chat_template: str | None) -> Any:
    """The tokenizer transformers builds from the GGUF metadata.

    ``PreTrainedTokenizerFast.from_pretrained(dir, gguf_file=...)`` builds the same tokenizer as
    ``AutoTokenizer`` does (the test suite checks this on the embedded model), but AutoTokenizer
    first parses the whole file again through transformers' legacy GGUF reader only to choose the
    class, which costs ~10 s for the embedded model.
    """
    from transformers import PreTrainedTokenizerFast

    try:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(
            str(path.parent), gguf_file=path.name, local_files_only=True
        )
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ModelLoadError(f"cannot build the tokenizer from {path}: {e}") from e
    if not getattr(tokenizer, "chat_template", None):
        if chat_template is None:
            chat_template = gguf_metadata(fast_gguf_reader(path)).get("tokenizer.chat_template")
        if isinstance(chat_template, str):
            tokenizer.chat_template = chat_template
    return tokenizer
