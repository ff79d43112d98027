"""Model loading: turns a model path into a config, dense weights and a tokenizer.

The public entry points: ``resolve_model_path`` finds the model (``locate``), ``load_model`` and
``load_tokenizer`` pick the reader by the path's kind, a Hugging Face folder (``hf_loader``) or a
``.gguf`` file (``gguf_loader``), and ``LoadedModel`` (``checkpoint``) is what ``load_model`` returns.
With ``load_format="dummy"`` (``--load-format dummy``) only the config and the tokenizer are read and the
weights are random (``dummy``).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from kvserve.errors import ModelLoadError
from kvserve.model.checkpoint import LoadedModel, check_weights
from kvserve.model.config import ModelConfig
from kvserve.model.dummy import checkpoint_dtype, dummy_weights
from kvserve.model.gguf_loader import gguf_config, gguf_tokenizer, load_gguf
from kvserve.model.hf_loader import hf_folder_config, hf_folder_tokenizer, load_hf_folder
from kvserve.model.locate import resolve_model_path

__all__ = ["LOAD_FORMATS", "LoadedModel", "load_model", "load_model_config", "load_tokenizer", "resolve_model_path"]

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "dummy")


def _is_gguf_file(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() == ".gguf"


def load_model(path: str | os.PathLike[str], keep_quantized: bool = False, load_format: str = "auto",
               seed: int = 0, with_tokenizer: bool = True) -> LoadedModel:
    """Load a Hugging Face folder or a GGUF file (see ``resolve_model_path``); with
    ``keep_quantized``, a GGUF's Q8_0/Q4_0/Q4_1/Q4_K weights stay quantized (``QuantWeight``), and MXFP4
    experts (a folder's or a GGUF's) become q8_0 ones, value for value.
    ``load_format`` "dummy": the weights are random, drawn with ``seed`` (``dummy_weights``); only
    the config and the tokenizer are read, so the folder needs no weights (any it has are ignored).
    ``with_tokenizer`` False: no tokenizer is built (``tokenizer`` None): a weight update keeps the served one."""
    path = Path(path)
    if load_format not in LOAD_FORMATS:
        raise ModelLoadError(f"unknown load format {load_format!r} (one of {', '.join(LOAD_FORMATS)})")
    if load_format == "dummy":
        return _load_dummy(path, seed, with_tokenizer)
    start = time.perf_counter()
    if path.is_dir():
        loaded = load_hf_folder(path, keep_quantized, with_tokenizer)
    elif _is_gguf_file(path):
        loaded = load_gguf(path, keep_quantized, with_tokenizer)
    else:
        raise ModelLoadError(f"cannot load {path}: expected a folder with config.json or a .gguf file")
    check_weights(loaded.config, loaded.weights, str(path))
    logger.info("loaded %s (%d tensors) in %.1fs", path, len(loaded.weights), time.perf_counter() - start)
    return loaded


def _load_dummy(path: Path, seed: int, with_tokenizer: bool = True) -> LoadedModel:
    """The config and tokenizer of ``path`` with random weights in the checkpoint's names, shapes and dtype."""
    start = time.perf_counter()
    config = load_model_config(path)
    dtype = checkpoint_dtype(path)
    weights = dummy_weights(config, dtype, seed)
    check_weights(config, weights, str(path))
    generated = time.perf_counter() - start
    tokenizer = load_tokenizer(path) if with_tokenizer else None
    params = sum(w.numel() for w in weights.values())
    # a warning, so that `kvserve generate` (which configures no logging) says it too
    logger.warning("dummy weights (--load-format dummy): %d random tensors for %s, %.2fB parameters in %s (seed %d), "
                   "generated in %.1fs; outputs are meaningless", len(weights), path, params / 1e9,
                   str(dtype).removeprefix("torch."), seed, generated)
    name = path.resolve().name if path.is_dir() else path.stem
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer, name=name)


def load_model_config(path: str | os.PathLike[str]) -> ModelConfig:
    """Only the ``ModelConfig`` of a Hugging Face folder or GGUF file (no weights are read: what
    ``bench roofline`` needs)."""
    path = Path(path)
    if path.is_dir():
        return hf_folder_config(path)
    if _is_gguf_file(path):
        return gguf_config(path)
    raise ModelLoadError(f"cannot load {path}: expected a folder with config.json or a .gguf file")


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """Only the tokenizer of a Hugging Face folder or GGUF file (no weights are read: the benchmark's
    --text-prompts and the tests need no more)."""
    path = Path(path)
    if path.is_dir():
        return hf_folder_tokenizer(path)
    if _is_gguf_file(path):
        return gguf_tokenizer(path, None)
    raise ModelLoadError(f"cannot load a tokenizer from {path}: expected a folder or a .gguf file")
