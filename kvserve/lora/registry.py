"""The torch-free side of LoRA adapters: what a request carries (``LoRARef``), where an adapter may be read from
(``--lora-dir``), and ``--lora-modules name=path`` parsed. The engine, the scheduler and the server use these;
the weights live in the runner (``kvserve.lora.manager``)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvserve.errors import InvalidArgumentError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


@dataclass(frozen=True)
class LoRARef:
    """One registered adapter: ``id`` is unique per registration (a name loaded again gets a new one), ``key``
    names its weights (a digest of the files), so the prefix cache and the KV tiers never mix two adapters'
    blocks, nor an adapter's with the base model's."""

    name: str
    id: int
    path: str
    key: bytes
    rank: int = 0

    def cache_seed(self, root_key: bytes) -> bytes:
        """The chain-hash seed of this adapter's blocks under the model's ``root_key`` (kv/radix_cache.py)."""
        return hashlib.blake2b(root_key + b"\x00lora\x00" + self.key, digest_size=16).digest()


def adapter_key(path: str) -> bytes:
    """A digest of the adapter's config and weights: equal files, equal key (on any replica)."""
    h = hashlib.blake2b(digest_size=16)
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        with open(os.path.join(path, name), "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.digest()


def confined_path(path: str, lora_dir: str | None) -> str:
    """``path`` resolved; with ``lora_dir``, refused unless it lies inside it (a relative path is taken under
    it). Runtime loads need a ``lora_dir``: without one a client could make the server read any folder."""
    if not isinstance(path, str) or not path:
        raise InvalidArgumentError("lora_path must be a non-empty string", param="lora_path")
    if lora_dir is None:
        raise InvalidArgumentError("loading adapters at run time needs --lora-dir (the folder they may be read "
                                   "from)", param="lora_path")
    root = os.path.realpath(lora_dir)
    full = os.path.realpath(os.path.join(root, path))
    if os.path.commonpath([root, full]) != root:
        raise InvalidArgumentError(f"lora_path must lie inside --lora-dir ({lora_dir})", param="lora_path")
    return full


def check_adapter_folder(path: str) -> None:
    """A clear error unless ``path`` holds PEFT's two files."""
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not os.path.isfile(os.path.join(path, name)):
            raise InvalidArgumentError(f"{path} is not a PEFT adapter folder: {name} is missing", param="lora_path")


def check_lora_name(name: str) -> str:
    if not isinstance(name, str) or not name or len(name) > 256 or any(c.isspace() for c in name):
        raise InvalidArgumentError("lora_name must be a non-empty name of at most 256 characters without spaces",
                                   param="lora_name")
    return name


def parse_lora_modules(specs: list[str]) -> dict[str, str]:
    """``--lora-modules name=path ...`` -> {name: path}, one line of error for a malformed entry."""
    out: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise InvalidArgumentError(f"--lora-modules takes name=path entries, got {spec!r}", param="lora_modules")
        if name in out:
            raise InvalidArgumentError(f"--lora-modules names {name!r} twice", param="lora_modules")
        out[check_lora_name(name)] = path
    return out


def adapter_fits(running: Iterable[Any], req: Any, max_loras: int) -> bool:
    """Whether ``req`` (a scheduler ``Request``) may run beside ``running`` without their adapters needing more
    than ``max_loras`` slots in one step."""
    if req.lora is None:
        return True
    ids = {r.lora.id for r in running if r.lora is not None}
    return req.lora.id in ids or len(ids) < max_loras
