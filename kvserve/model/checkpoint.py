"""What a loaded checkpoint is: ``LoadedModel`` and the weights the engine expects of it.

Both loaders (``hf_loader``, ``gguf_loader``) produce a ``LoadedModel`` whose weights are torch
tensors named as in the architecture's Hugging Face checkpoints; ``check_weights`` holds them to the
names and shapes the config implies (``kvserve.model.weights``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvserve.errors import ModelLoadError
from kvserve.model.config import ModelConfig
from kvserve.model.weights import expected_weight_shapes


@dataclass
class LoadedModel:
    """Everything the engine needs from a checkpoint."""

    config: ModelConfig
    # Hugging Face names (``kvserve.model.weights``); "lm_head.weight" only when the embeddings are untied
    weights: dict[str, torch.Tensor]
    tokenizer: Any  # transformers PreTrainedTokenizerFast (TokenizersBackend in transformers 5); None if not asked for
    name: str  # reported by /v1/models: folder name or .gguf file stem

    def hand_over(self) -> "ReleasableWeights":
        """The weights, for one model build, which may release each tensor once a layer holds its own form
        of it; this LoadedModel keeps none."""
        weights, self.weights = ReleasableWeights(self.weights), {}
        return weights


class ReleasableWeights(dict):
    """Checkpoint tensors handed to a single model build (``LoadedModel.hand_over``): the build drops each
    tensor once the layers that read it are made (quantized, or copied into a parameter), so a model
    quantized at load never holds all of its dense weights and all of their quantized copies at once
    (an 8B model at int4 in 24 GiB)."""


def check_weights(config: ModelConfig, weights: dict[str, torch.Tensor], source: str) -> None:
    """Raise ``ModelLoadError`` unless ``weights`` holds every expected tensor in its expected shape. A tensor whose
    shape differs only by dims of size 1 (a router's bias stored [1, experts] by one checkpoint, [experts] by
    another) is viewed in the expected shape, in ``weights``; so is a stacked expert tensor whose last two dims are
    swapped (Qwen3-VL-MoE's published files store [experts, in, out], transformers 5 saves [experts, out, in])."""
    expected = expected_weight_shapes(config)
    missing = [name for name in expected if name not in weights]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ModelLoadError(f"{source}: missing weights {', '.join(missing[:5])}{more}")
    for name, shape in expected.items():
        got = weights[name]
        if isinstance(got, torch.Tensor) and tuple(got.shape) != shape and \
                [d for d in got.shape if d != 1] == [d for d in shape if d != 1]:
            weights[name] = got = got.reshape(shape)
        if isinstance(got, torch.Tensor) and got.dim() == 3 and tuple(got.shape) != shape and \
                (got.shape[0], got.shape[2], got.shape[1]) == shape:
            weights[name] = got = got.transpose(1, 2)  # stacked experts the other way round (see the docstring)
        if tuple(got.shape) != shape:
            raise ModelLoadError(
                f"{source}: {name} has shape {tuple(weights[name].shape)}, the config implies {shape}"
            )
