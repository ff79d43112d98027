"""Model loading: turns a model path into a config, dense weights and a tokenizer.

The public entry points: ``resolve_model_path`` finds the model (``locate``), ``load_model`` and
``load_tokenizer`` pick the reader by the path's kind, a Hugging Face folder (``hf_loader``) or a
``.gguf`` file (``gguf_loader``), and ``LoadedModel`` (``checkpoint``) is what ``load_model`` returns.
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
from kvserve.model.gguf_loader import gguf_config, gguf_tokenizer, load_gguf
from kvserve.model.hf_loader import hf_folder_config, hf_folder_tokenizer, load_hf_folder
from kvserve.model.locate import resolve_model_path

__all__ = ["LoadedModel", "load_model", "load_model_config", "load_tokenizer", "resolve_model_path"]

logger = logging.getLogger(__name__)


def _is_gguf_file(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() == ".gguf"


def load_model(path: str | os.PathLike[str], keep_quantized: bool = False) -> LoadedModel:
    """Load a Hugging Face folder or a GGUF file (see ``resolve_model_path``); with
    ``keep_quantized``, a GGUF's Q8_0/Q4_0/Q4_1 weights stay quantized (``QuantWeight``)."""
    path = Path(path)
    start = time.perf_counter()
    if path.is_dir():
        loaded = load_hf_folder(path)
    elif _is_gguf_file(path):
        loaded = load_gguf(path, keep_quantized)
    else:
        raise ModelLoadError(f"cannot load {path}: expected a folder with config.json or a .gguf file")
    check_weights(loaded.config, loaded.weights, str(path))
    logger.info("loaded %s (%d tensors) in %.1fs", path, len(loaded.weights), time.perf_counter() - start)
    return loaded


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
