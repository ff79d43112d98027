"""Loading a Hugging Face model folder: config.json (+ generation_config.json), safetensors, tokenizer.

Weights are read as stored (bf16/fp16/fp32; gpt-oss's MXFP4 experts kept as q8_0 when asked to keep
quantized weights, the same values, else dequantized to bf16), from one
``model.safetensors`` or an indexed set of shards; the tokenizer is whatever ``AutoTokenizer`` builds from the folder, offline.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from kvserve.errors import ModelLoadError
from kvserve.model.architectures import UnsupportedArchitecture, get_architecture
from kvserve.model.checkpoint import LoadedModel
from kvserve.model.config import ModelConfig
from kvserve.model.mxfp4 import dequantize_mxfp4, mxfp4_experts_q8_0
from kvserve.model.weight_layout import standard_layout
from kvserve.model.weights import expected_weight_shapes

log = logging.getLogger(__name__)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e


def hf_folder_config(folder: Path) -> ModelConfig:
    """Only the ``ModelConfig`` of a Hugging Face folder (config.json and generation_config.json)."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"folder {folder} has no config.json")
    try:
        config = ModelConfig.from_hf_dict(_read_json(config_path))
    except UnsupportedArchitecture as e:
        raise ModelLoadError(f"{folder}: {e}") from e
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{config_path}: unusable config ({type(e).__name__}: {e})") from e
    generation_path = folder / "generation_config.json"
    if generation_path.is_file():
        eos = _read_json(generation_path).get("eos_token_id")
        extra = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        config.eos_token_ids = list(dict.fromkeys([*config.eos_token_ids, *extra]))
    return config


def load_hf_folder(folder: Path, keep_quantized: bool = False, with_tokenizer: bool = True) -> LoadedModel:
    """Config, weights and tokenizer of a Hugging Face folder (weights not yet checked); with ``keep_quantized``,
    MXFP4 experts come as ``QuantExperts`` (q8_0)."""
    config = hf_folder_config(folder)
    method = (_read_json(folder / "config.json").get("quantization_config") or {}).get("quant_method")
    if method not in (None, "mxfp4"):  # gpt-oss's MXFP4 experts are read (kvserve.model.mxfp4); no other scheme is
        raise ModelLoadError(f"{folder}: {method} checkpoints (config.json's quantization_config) are not read; use "
                             "the bf16/fp16 checkpoint or a GGUF file")
    wanted = expected_weight_shapes(config)
    weights = standard_layout(config, _read_safetensors(folder, wanted, config.architecture, keep_quantized,
                                                        config.checkpoint_layers))
    tokenizer = hf_folder_tokenizer(folder) if with_tokenizer else None
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer, name=folder.resolve().name)


def _read_safetensors(folder: Path, wanted: dict[str, tuple[int, ...]], architecture: str = "LlamaForCausalLM",
                      keep_quantized: bool = False, layers: list[int] | None = None) -> dict[str, Any]:
    """Read the wanted tensors, as stored (bf16/fp16/fp32; MXFP4 ones as ``QuantExperts`` with ``keep_quantized``,
    else dequantized to bf16: ``kvserve.model.mxfp4``),
    from one file or an indexed set of shards, named as ours (``Architecture.checkpoint_name``: a multimodal
    checkpoint's text model under its prefix)."""
    arch = get_architecture(architecture)
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
        raise ModelLoadError(f"{folder} has neither model.safetensors nor model.safetensors.index.json; to run it "
                             "with random weights (benchmarks), pass --load-format dummy")

    weights: dict[str, torch.Tensor] = {}
    packed: dict[str, torch.Tensor] = {}  # MXFP4 parts (<name>_blocks, <name>_scales) of wanted tensors
    others = 0  # tensors outside the text model (a vision tower): not read
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for stored in f.keys():
                    name = arch.checkpoint_name(stored, layers)
                    others += name is None
                    # Extra entries (a tied lm_head, rotary buffers of old checkpoints) are not needed.
                    if name in wanted:
                        weights[name] = f.get_tensor(stored)
                    elif name is not None and name.endswith(("_blocks", "_scales")) and name[:-7] in wanted:
                        packed[name] = f.get_tensor(stored)
        except (OSError, ValueError, RuntimeError) as e:  # safetensors raises SafetensorError(ValueError)
            raise ModelLoadError(f"cannot read {file}: {e}") from e
    for name in wanted:
        if name not in weights and f"{name}_blocks" in packed and f"{name}_scales" in packed:
            blocks, scales = packed.pop(f"{name}_blocks"), packed.pop(f"{name}_scales")
            weights[name] = _mxfp4(name, blocks, scales, keep_quantized, arch)
    if others:
        log.info("%s: text only; %d tensors outside the text model (vision tower, projector, cross-attention "
                 "layers) not read", folder, others)
    return weights


def _mxfp4(name: str, blocks: torch.Tensor, scales: torch.Tensor, keep_quantized: bool, arch: Any) -> Any:
    """A stacked MXFP4 expert tensor as q8_0 (``QuantExperts``) where kept quantized and its scales allow, else
    dequantized to bf16 (and logged, where q8_0 was asked for)."""
    if keep_quantized:
        stacked = arch.stacked_experts
        try:
            return mxfp4_experts_q8_0(blocks, scales, interleaved=stacked is not None and stacked.interleaved
                                      and name.endswith(stacked.gate_up))
        except ValueError as e:
            log.warning("%s: dequantized to bf16, not kept as q8_0: %s", name, e)
    return dequantize_mxfp4(blocks, scales)


def hf_folder_tokenizer(folder: Path) -> Any:
    """The tokenizer ``AutoTokenizer`` builds from ``folder``, without touching the hub."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ModelLoadError(f"cannot load the tokenizer in {folder}: {e}") from e
