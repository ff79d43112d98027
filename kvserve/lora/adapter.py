"""A PEFT LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``) loaded onto the decoder's own
linears, and checked against the model.

The decoder fuses q/k/v into one GEMM and gate/up into another (``kvserve.model.weights``); an adapter names
PEFT's modules (``q_proj``, ...). Each adapted module becomes a ``ModuleDelta`` of the fused linear it is part
of: its ``lora_A`` rows stacked over the parts (the shrink), and ``lora_B`` rows (transposed, scaled by
alpha / r, or alpha / sqrt(r) with rslora) with the output columns of the fused linear each part writes (the
expand)."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from kvserve.errors import InvalidArgumentError
from kvserve.lora.registry import ADAPTER_CONFIG, ADAPTER_WEIGHTS, LoRARef, check_adapter_folder
from kvserve.model.architectures import get_architecture
from kvserve.model.config import ModelConfig
from kvserve.model.weight_layout import deinterleave_rotary
from kvserve.model.weights import linear_sources, weight_sources

PEFT_PREFIX = "base_model.model."


@dataclass
class ModuleDelta:
    """y += (x @ a^T) @ B for one of the decoder's linears: ``a`` [k, in]; ``parts``: per adapted part of a fused
    linear, its rows (start, end) of ``a`` and ``b`` and the output columns (lo, hi) it writes: B's rows start:end
    are ``b[start:end, :hi - lo]`` at columns lo:hi, zero elsewhere (``b`` [k, widest part], scaled)."""

    a: torch.Tensor
    b: torch.Tensor
    parts: list[tuple[int, int, int, int]] = field(default_factory=list)


@dataclass
class LoRAAdapter:
    ref: LoRARef
    rank: int
    deltas: dict[str, ModuleDelta] = field(default_factory=dict)  # our module path -> its delta

    @property
    def nbytes(self) -> int:
        return sum(d.a.nbytes + d.b.nbytes for d in self.deltas.values())


@dataclass(frozen=True)
class _Target:
    path: str  # our linear module ("layers.0.self_attn.qkv")
    rows: tuple[int, int]  # the output rows of the fused linear this part writes
    in_features: int
    out_features: int  # of the fused linear


def adaptable_modules(cfg: ModelConfig) -> dict[str, _Target]:
    """Checkpoint module name ("model.layers.0.self_attn.q_proj") -> where its LoRA goes in our decoder. Routed
    experts are left out: their rows are gathered per expert, which the grouped LoRA does not follow."""
    sources = weight_sources(cfg)
    out: dict[str, _Target] = {}
    for path, names in linear_sources(cfg, sources).items():
        if ".experts." in path:
            continue
        shapes = [shape for _, shape in sources[path + ".weight"]]
        total = sum(s[0] for s in shapes)
        lo = 0
        for name, shape in zip(names, shapes):
            out[name.removesuffix(".weight")] = _Target(path, (lo, lo + shape[0]), shape[1], total)
            lo += shape[0]
    return out


def supported_target_names(cfg: ModelConfig) -> list[str]:
    """The module names an adapter of this model may target (q_proj, ..., as its checkpoints name them)."""
    return sorted({name.rpartition(".")[2] for name in adaptable_modules(cfg)})


def read_adapter_config(path: str) -> dict[str, Any]:
    check_adapter_folder(path)
    try:
        with open(os.path.join(path, ADAPTER_CONFIG)) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise InvalidArgumentError(f"{path}: {ADAPTER_CONFIG} cannot be read: {e}", param="lora_path") from None
    if not isinstance(config, dict):
        raise InvalidArgumentError(f"{path}: {ADAPTER_CONFIG} must hold a JSON object", param="lora_path")
    return config


def _check_config(config: dict[str, Any], path: str) -> None:
    def bad(why: str) -> InvalidArgumentError:
        return InvalidArgumentError(f"adapter {path}: {why}", param="lora_path")

    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise bad(f"peft_type {config.get('peft_type')} is not LoRA")
    if config.get("use_dora"):
        raise bad("DoRA adapters (use_dora) are not supported")
    if config.get("bias", "none") != "none":
        raise bad("adapters that train biases (bias != 'none') are not supported")
    if config.get("fan_in_fan_out"):
        raise bad("fan_in_fan_out adapters are not supported")
    if config.get("modules_to_save"):
        raise bad("adapters with modules_to_save (whole modules replaced) are not supported")


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern: the first key that matches the module name's tail."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?{key}$", module):
            return value
    return default


def load_adapter(ref: LoRARef, cfg: ModelConfig, max_rank: int, dtype: torch.dtype) -> LoRAAdapter:
    """The adapter at ``ref.path`` as deltas on ``cfg``'s linears, in ``dtype``; InvalidArgumentError for an
    adapter this model cannot take (a module it lacks, a rank over ``max_rank``, shapes of another model)."""
    from safetensors.torch import load_file

    path = ref.path
    config = read_adapter_config(path)
    _check_config(config, path)
    targets = adaptable_modules(cfg)
    arch = get_architecture(cfg.architecture)
    try:
        tensors = load_file(os.path.join(path, ADAPTER_WEIGHTS))
    except Exception as e:  # noqa: BLE001 - any unreadable file is the user's to fix
        raise InvalidArgumentError(f"{path}: {ADAPTER_WEIGHTS} cannot be read: {e}", param="lora_path") from None
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        module, _, kind = key.removeprefix(PEFT_PREFIX).removesuffix(".weight").rpartition(".")
        if kind not in ("lora_A", "lora_B"):  # a whole module saved (an embedding, the LM head), DoRA's magnitudes
            raise InvalidArgumentError(f"adapter {path} holds {key}, not a LoRA A/B weight: kvserve adapts only "
                                       f"these linears of {cfg.architecture}: {', '.join(supported_target_names(cfg))}",
                                       param="lora_path")
        pairs.setdefault(module, {})[kind] = t
    base = config.get("base_model_name_or_path") or "its base model"
    alpha, r = config.get("lora_alpha", 8), config.get("r", 8)
    deltas: dict[str, list[tuple[_Target, torch.Tensor, torch.Tensor]]] = {}
    rank = 0
    for module, ab in sorted(pairs.items()):
        ours = arch.checkpoint_name(module + ".weight", cfg.checkpoint_layers)
        target = targets.get(ours.removesuffix(".weight")) if ours else None
        if target is None:
            raise InvalidArgumentError(
                f"adapter {path} targets {module}, which kvserve cannot adapt in {cfg.architecture} (supported "
                f"target modules: {', '.join(supported_target_names(cfg))}; not routed experts)", param="lora_path")
        if set(ab) != {"lora_A", "lora_B"}:
            raise InvalidArgumentError(f"adapter {path}: {module} lacks its lora_A or lora_B", param="lora_path")
        a, b = ab["lora_A"], ab["lora_B"]
        part_rows = target.rows[1] - target.rows[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or a.shape[1] != target.in_features \
                or b.shape[0] != part_rows:
            raise InvalidArgumentError(
                f"adapter {path} does not fit this model: {module} is [{part_rows}, {target.in_features}] here, the "
                f"adapter's A/B are {list(a.shape)}/{list(b.shape)} (trained for {base}?)", param="lora_path")
        mr = int(_pattern_value(config.get("rank_pattern"), module, r))
        ma = float(_pattern_value(config.get("alpha_pattern"), module, alpha))
        if a.shape[0] != mr:
            raise InvalidArgumentError(f"adapter {path}: {module} has rank {a.shape[0]}, its config says {mr}",
                                       param="lora_path")
        if mr > max_rank:
            raise InvalidArgumentError(f"adapter {path} has rank {mr}, over --max-lora-rank {max_rank}",
                                       param="lora_path")
        rank = max(rank, mr)
        scale = ma / math.sqrt(mr) if config.get("use_rslora") else ma / mr
        if cfg.rope_interleaved:  # q's and k's rows reordered as the model's own (kvserve.model.weights)
            b = deinterleave_rotary(cfg, {ours: b})[ours]
        deltas.setdefault(target.path, []).append((target, a.float(), b.float() * scale))
    if not deltas:
        raise InvalidArgumentError(f"adapter {path} holds no LoRA weights", param="lora_path")
    out = LoRAAdapter(ref, rank)
    for mpath, parts in deltas.items():
        a = torch.cat([pa for _, pa, _ in parts])
        b = torch.zeros(a.shape[0], max(pb.shape[0] for _, _, pb in parts))
        k, spans = 0, []
        for target, pa, pb in parts:
            b[k : k + pa.shape[0], : pb.shape[0]] = pb.t()
            spans.append((k, k + pa.shape[0], *target.rows))
            k += pa.shape[0]
        out.deltas[mpath] = ModuleDelta(a.to(dtype).contiguous(), b.to(dtype).contiguous(), spans)
    return out
