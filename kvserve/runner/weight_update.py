"""New weights for a running engine, and memory given back: the torch side of sleep, wake and
``update_weights_from_disk``.

``ModelSource`` says where the served weights came from (a level-2 sleep reloads them from there on
wake); ``load_replacement`` loads a checkpoint and refuses, in one line, one that cannot take the served
model's place: another architecture or other tensor shapes, another sliding window, or a shorter context
than the engine serves. The KV pool's layout, the scheduler and the API process's checks were all sized
from the served model, so those must not change; everything else (rotary base, norms' eps, the values)
follows the new checkpoint. The tokenizer stays the served one.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve.errors import InvalidArgumentError, KVServeError, ModelLoadError
from kvserve.model.config import ModelConfig
from kvserve.model.weights import expected_weight_shapes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSource:
    path: str
    load_format: str = "auto"
    seed: int = 0  # of --load-format dummy's weights


def load_replacement(source: ModelSource, served: ModelConfig, max_model_len: int,
                     quantization: str) -> tuple[ModelConfig, dict[str, Any]]:
    """The config and weights at ``source``, checked against the ``served`` model's (``max_model_len``: the
    context the engine serves). Raises ModelLoadError (not found, unreadable) or InvalidArgumentError (does
    not fit), with the path and the reason in one line."""
    from kvserve.model.loader import load_model

    path = Path(source.path)
    if not path.exists():
        raise ModelLoadError(f"model_path {source.path}: no such file or folder")
    try:
        loaded = load_model(path, keep_quantized=quantization != "none", load_format=source.load_format,
                            seed=source.seed, with_tokenizer=False)
    except KVServeError:
        raise
    except Exception as e:  # noqa: BLE001 - a corrupt checkpoint is the caller's error, not the engine's end
        log.exception("loading %s failed", path)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ModelLoadError(f"cannot load {path}: {first}") from e
    problem = replacement_problem(served, loaded.config, max_model_len)
    if problem is not None:
        raise InvalidArgumentError(f"{path} cannot replace the served model: {problem}", param="model_path")
    return loaded.config, loaded.hand_over()


def replacement_problem(served: ModelConfig, new: ModelConfig, max_model_len: int) -> str | None:
    """Why a model of config ``new`` cannot take the ``served`` one's place in its engine (None: it can)."""
    if new.architecture != served.architecture:
        return f"its architecture is {new.architecture}, the served model's is {served.architecture}"
    old_shapes, new_shapes = expected_weight_shapes(served), expected_weight_shapes(new)
    for name in sorted(old_shapes.keys() | new_shapes.keys()):
        a, b = old_shapes.get(name), new_shapes.get(name)
        if a != b:
            return f"{name} has shape {b or 'none'} there and {a or 'none'} in the served model"
    if new.kv_window() != served.kv_window():
        return f"its sliding window is {new.kv_window()}, the served model's is {served.kv_window()}"
    if new.max_position_embeddings < max_model_len:
        return f"its context window ({new.max_position_embeddings} tokens) is shorter than the served {max_model_len}"
    return None


def give_back_memory() -> None:
    """Return freed memory to the system now: collect cycles, then ask glibc to trim its heaps (freed
    tensors under its mmap threshold would otherwise stay in the process's resident set)."""
    gc.collect()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass
