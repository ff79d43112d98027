"""Dummy weights (``--load-format dummy``, vLLM's meaning): random tensors where a checkpoint's would be.

A folder that holds only config.json and a tokenizer then runs at its real size, so a model of any
size can be served and benchmarked without its weights (its outputs are meaningless). The names and
shapes are those ``expected_weight_shapes`` lists (``kvserve.model.weights``), the one list of what the engine reads from a
checkpoint, so the tensors take the loaded weights' path from there on: ``check_weights``, quantization
at load (``quantized_modules``), ``CausalLM.from_hf_weights``.

Values: normals of std 0.02 (an initializer's scale) from one generator seeded with ``--seed``, so a
seed always gives the same weights; the norms' weights are ones. Each tensor is allocated once, in the
dtype the checkpoint declares (config.json's ``torch_dtype``, else bfloat16), and filled in place: no
float32 copy to cast from. 150-200 M values a second on one core of the development VM: under a
minute for an 8B model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kvserve.model.weights import expected_weight_shapes
from kvserve.model.config import ModelConfig

DUMMY_STD = 0.02
DEFAULT_DTYPE = torch.bfloat16  # what published checkpoints store
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def dummy_weights(config: ModelConfig, dtype: torch.dtype = DEFAULT_DTYPE, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random tensor for every weight the engine reads from a checkpoint of ``config``, named and
    shaped as the checkpoint's; the same ``seed`` gives the same tensors."""
    generator = torch.Generator().manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for name, shape in expected_weight_shapes(config).items():
        if name.endswith("norm.weight"):  # RMSNorm scales: 1, as initialized (Gemma stores them less its offset)
            weights[name] = torch.full(shape, 1.0 - config.norm_offset, dtype=dtype)
        else:
            weights[name] = torch.empty(shape, dtype=dtype).normal_(0.0, DUMMY_STD, generator=generator)
    return weights


def checkpoint_dtype(path: Path) -> torch.dtype:
    """The dtype a Hugging Face folder's config.json says its weights are stored in (``torch_dtype``, or
    ``dtype`` as transformers 5 writes it); bfloat16 when it says none or the path is a .gguf file."""
    try:
        with open(path / "config.json", encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError):  # a .gguf file, or no readable config (the loader reports that)
        return DEFAULT_DTYPE
    declared = (raw.get("torch_dtype") or raw.get("dtype")) if isinstance(raw, dict) else None
    return _DTYPES.get(declared, DEFAULT_DTYPE) if isinstance(declared, str) else DEFAULT_DTYPE
