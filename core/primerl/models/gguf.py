"""GGUF files (llama.cpp's and Ollama's format) as HF checkpoint folders.

``--model.checkpoint FILE.gguf`` works for ``--model hf`` and for every model plugin whose
``model_types`` cover the file's architecture: the file is converted once into a folder in
the published HF layout (``config.json``, ``model.safetensors``, the tokenizer with its chat
template), which every process then reads as any other checkpoint. The folder lives in the
cache (``model.cache_dir``) under the SHA-256 of the file's content, so a second run starts
in seconds, a copy of the same file anywhere reuses it, and a changed file converts again.

What the conversion reads is transformers' GGUF support (``load_gguf_checkpoint``: the
metadata mapped to an HF config, tensors renamed to HF's names and dequantized by the
``gguf`` package, llama.cpp's q/k row permutation undone); what it writes is transformers'
``save_pretrained`` of that model, so a fused in-memory layout (MoE experts) is written in
the published one. Quantized weights become float32: primerl trains and serves dense
weights.

A file that is not GGUF, is cut short, has an architecture transformers cannot map, or
holds a quantization type the ``gguf`` package cannot dequantize is refused with one line
(:class:`GGUFError`) naming the file and the problem. Light at import: nothing heavy is
imported before a conversion runs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from primerl.errors import PrimerlError

MAGIC = b"GGUF"
MARKER = "primerl-gguf.json"  # written last into a finished folder: what it was converted from
FORMAT_VERSION = 1  # of the converted folder; a folder of another version is converted again


class GGUFError(PrimerlError):
    """A GGUF file that cannot be converted; the message names the file and the problem."""


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` is a file that starts as a GGUF file does."""
    p = Path(path)
    if not p.is_file():
        return False
    with p.open("rb") as f:
        return f.read(4) == MAGIC


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/primerl``, else ``~/.cache/primerl``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "primerl"


def checkpoint_folder(path: str | Path, cache_dir: str | Path | None = None,
                      log: Any = None) -> Path:
    """The HF folder converted from the GGUF file ``path``, converting it first when the cache
    has none for its content. Concurrent callers (the trainer and a server started together)
    convert once: the others wait on the same lock and then read the folder."""
    src = Path(path).resolve()
    _check_magic(src)
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    digest = content_digest(src, root)
    dest = root / "gguf" / digest[:32]
    if _finished(dest):
        return dest
    (root / "gguf").mkdir(parents=True, exist_ok=True)
    with _locked(root / "gguf" / f"{digest[:32]}.lock"):
        if _finished(dest):  # another process converted it while we waited
            return dest
        preflight(src)  # a file that cannot be converted is refused before anything is said or written
        say = log or (lambda _msg: None)
        say(f"converting {src} (GGUF) into {dest}: once per file content")
        t0 = time.monotonic()
        tmp = dest.with_name(dest.name + f".tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            info = convert(src, tmp)
            (tmp / MARKER).write_text(json.dumps({
                "format": "primerl.gguf", "version": FORMAT_VERSION, "source": str(src), "sha256": digest,
                "size": src.stat().st_size, **info}, indent=2) + "\n")
            shutil.rmtree(dest, ignore_errors=True)
            tmp.rename(dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        say(f"converted {src.name} in {time.monotonic() - t0:.1f} s")
    return dest


def content_digest(path: Path, root: Path) -> str:
    """SHA-256 of the file's bytes. Hashing a large file takes a while, so the digest is
    remembered in ``root/gguf/digests.json`` under the file's path, size and mtime: a file
    changed in place (another size or mtime) is hashed again."""
    stat = path.stat()
    key = f"{path}|{stat.st_size}|{stat.st_mtime_ns}"
    index = root / "gguf" / "digests.json"
    try:
        known = json.loads(index.read_text())
    except (OSError, ValueError):
        known = {}
    if isinstance(known, dict) and isinstance(known.get(key), str):
        return known[key]
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    digest = h.hexdigest()
    if not isinstance(known, dict):
        known = {}
    known[key] = digest
    with contextlib.suppress(OSError):  # a read-only cache still works, hashing each time
        index.parent.mkdir(parents=True, exist_ok=True)
        tmp = index.with_name(f"digests.json.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(known, indent=1))
        tmp.replace(index)
    return digest


def _finished(dest: Path) -> bool:
    try:
        marker = json.loads((dest / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("version") == FORMAT_VERSION


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    import fcntl

    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _check_magic(path: Path) -> None:
    if not path.is_file():
        raise GGUFError(f"{path}: no such file")
    with path.open("rb") as f:
        head = f.read(4)
    if head != MAGIC:
        raise GGUFError(f"{path} is not a GGUF file (it does not start with 'GGUF'): give a .gguf file, a local HF "
                        f"checkpoint folder, or a checkpoint name from `primerl models list`")


def preflight(path: Path) -> None:
    """What can be known before converting: the file is whole, its architecture is one
    transformers maps, every tensor's quantization type can be dequantized (GGUFError)."""
    reader = _reader(path)
    bad = _undequantizable(reader)
    if bad:
        raise GGUFError(f"{path}: {bad}")
    _parsed(path, tensors=False)


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The file's architecture, HF config, tensor count and quantization types, without
    dequantizing anything (a GGUFError names a cut-short file or an unmapped architecture)."""
    reader = _reader(Path(path))
    parsed = _parsed(Path(path), tensors=False)
    return {"architecture": _field(reader, "general.architecture"), "config": parsed["config"],
            "tensors": len(reader.tensors),
            "quantization": sorted({t.tensor_type.name for t in reader.tensors})}


def _reader(path: Path) -> Any:
    from gguf import GGUFReader

    _check_magic(path)
    try:
        reader = GGUFReader(str(path))
    except Exception as exc:  # noqa: BLE001 - the reader reports a short file in many ways
        raise GGUFError(f"{path} is not a whole GGUF file ({path.stat().st_size:,} bytes; cut short or damaged: "
                        f"{type(exc).__name__}: {exc}); download or copy it again") from None
    return reader


def _field(reader: Any, key: str) -> Any:
    import numpy as np  # the reader's fields are numpy arrays

    field = reader.fields.get(key)
    if field is None:
        return None
    value = field.parts[field.data[0]]
    try:
        return bytes(value).decode("utf-8")
    except (TypeError, ValueError):
        return value.tolist() if isinstance(value, np.ndarray) else value


def _parsed(path: Path, *, tensors: bool, model: Any = None) -> dict[str, Any]:
    """transformers' reading of the file (its config and tokenizer metadata; the tensors in
    HF names, float32, when ``tensors``)."""
    import logging

    import torch
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    logging.getLogger("transformers.modeling_gguf_pytorch_utils").setLevel(logging.ERROR)
    try:
        return load_gguf_checkpoint(str(path), return_tensors=tensors, model_to_load=model,
                                    torch_dtype=torch.float32)
    except NotImplementedError as exc:
        raise GGUFError(f"{path}: {_unreadable(path, exc)}") from None
    except ValueError as exc:
        if "not supported" in str(exc):
            from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

            arch = _field(_reader(path), "general.architecture")
            known = ", ".join(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer"))
            raise GGUFError(f"{path}: GGUF architecture {arch!r} is not one transformers can read ({known}); "
                            f"convert the model to an HF checkpoint folder another way") from None
        raise GGUFError(f"{path} cannot be read: {exc}") from None


def _unreadable(path: Path, exc: Exception) -> str:
    """What a dequantization failure means: the tensors whose quantization type the gguf
    package cannot dequantize, else the error itself."""
    return _undequantizable(_reader(path)) or f"cannot be converted: {exc}"


def _undequantizable(reader: Any) -> str | None:
    """The quantization types (and a tensor of each) the gguf package cannot dequantize."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import _type_traits

    plain = {Q.F32, Q.F16, Q.BF16, Q.F64, Q.I8, Q.I16, Q.I32, Q.I64}
    bad = sorted({t.tensor_type.name for t in reader.tensors if t.tensor_type not in plain
                  and t.tensor_type not in _type_traits})
    if not bad:
        return None
    first = next(t.name for t in reader.tensors if t.tensor_type.name in bad)
    return (f"quantization type {', '.join(bad)} (tensor {first}) cannot be dequantized by the installed gguf "
            f"package; upgrade it (pip install -U gguf) or use a file quantized otherwise (Q4_K_M, Q8_0, F16...)")


def convert(path: Path, dest: Path) -> dict[str, Any]:
    """Write the HF folder of the GGUF file ``path`` into ``dest``; returns what it read
    (architecture, model_type, quantization types)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    reader = _reader(path)
    quant = sorted({t.tensor_type.name for t in reader.tensors})
    meta = _parsed(path, tensors=False)
    config = {k: v for k, v in meta["config"].items() if k != "quantization_config"}
    model_type = config.pop("model_type", None)
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise GGUFError(f"{path}: its model type {model_type!r} is not a causal LM the installed transformers has a "
                        f"class for")
    hf_config = AutoConfig.for_model(model_type, **config)
    hf_config.dtype = torch.float32
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    tensors = _parsed(path, tensors=True, model=model)["tensors"]
    result = model.load_state_dict(tensors, strict=False, assign=True)
    tied = {"lm_head.weight"} if getattr(hf_config, "tie_word_embeddings", False) else set()
    missing = sorted(set(result.missing_keys) - tied)
    if missing:
        raise GGUFError(f"{path}: the file lacks weights the {model_type} model needs ({', '.join(missing[:4])}"
                        f"{'...' if len(missing) > 4 else ''})")
    model.tie_weights()
    dest.mkdir(parents=True)
    model.save_pretrained(str(dest))
    _save_tokenizer(path, dest)
    del model, tensors
    return {"architecture": _field(reader, "general.architecture"), "model_type": model_type,
            "quantization": quant, "name": _field(reader, "general.name")}


def _save_tokenizer(path: Path, dest: Path) -> None:
    """The file's tokenizer (vocabulary, merges, special tokens, chat template) as HF files."""
    import logging

    from transformers import AutoTokenizer

    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:  # noqa: BLE001 - transformers' converters raise many kinds
        raise GGUFError(f"{path}: its tokenizer cannot be read by transformers ({type(exc).__name__}: {exc})") from None
    tok.save_pretrained(str(dest))
