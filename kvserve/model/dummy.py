"""Dummy weights (``--load-format dummy``, vLLM's meaning): random tensors where a checkpoint's would be.

A folder that holds only config.json and a tokenizer then runs at its real size, so a model of any
size can be served and benchmarked without its weights (its outputs are meaningless). The names and
shapes are those ``expected_weight_shapes`` lists (``kvserve.model.weights``), the one list of what the engine reads from a
checkpoint, so the tensors take the loaded weights' path from there on: ``check_weights``, quantization
at load (``quantized_modules``), ``CausalLM.from_hf_weights``.

Values: normals of std 0.02 (an initializer's scale), the norms' weights ones. One pool of normals, drawn
from one generator seeded with ``--seed``, a little longer than the largest tensor, and every other
tensor a window of it at its own offset (a view, not a copy): a seed always gives the same weights, and
drawing them costs the memory and time of the largest tensor, not of the model. Every reader copies
them (into parameters, or quantized), so an 8B model's start holds its dense weights a tensor at a
time, not 16 GB of them, and a bf16 model is not held twice while built.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from kvserve.model.weights import expected_weight_shapes
from kvserve.model.config import ModelConfig

DUMMY_STD = 0.02
DEFAULT_DTYPE = torch.bfloat16  # what published checkpoints store
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def dummy_weights(config: ModelConfig, dtype: torch.dtype = DEFAULT_DTYPE, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random tensor for every weight the engine reads from a checkpoint of ``config``, named and
    shaped as the checkpoint's; the same ``seed`` gives the same tensors. They are views of one pool of
    random values (at distinct offsets), so the caller must copy, never write, them."""
    shapes = expected_weight_shapes(config)
    drawn = {name: shape for name, shape in shapes.items() if not name.endswith("norm.weight")}
    largest = max((math.prod(shape) for shape in drawn.values()), default=0)
    spread = max(largest // 8, 16 * len(drawn), 4096)  # room for every tensor's own offset
    generator = torch.Generator().manual_seed(seed)
    pool = torch.empty(largest + spread, dtype=dtype).normal_(0.0, DUMMY_STD, generator=generator)
    stride = spread // max(len(drawn), 1)
    jitter = torch.randint(0, stride, (len(drawn),), generator=generator).tolist()
    offsets = {name: i * stride + j for i, (name, j) in enumerate(zip(drawn, jitter))}
    weights: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        if name in offsets:
            start = offsets[name]
            weights[name] = pool[start:start + math.prod(shape)].view(shape)
        else:  # RMSNorm scales: 1, as initialized (Gemma stores them less its offset)
            weights[name] = torch.full(shape, 1.0 - config.norm_offset, dtype=dtype)
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
