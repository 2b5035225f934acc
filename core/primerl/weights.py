"""Moving weights from the trainer to inference servers.

Two channels, one reader:

* **filesystem** — an HF checkpoint directory (``config.json`` + ``model.safetensors`` or
  shards with ``model.safetensors.index.json``) written under the run directory, which
  is shared across nodes on a cluster. Servers are told by an admin call to load it.
* **shm** — for a trainer and server on the same machine: one safetensors file in
  ``/dev/shm`` (tmpfs, no disk), written in a single pass.

The reader memory-maps each safetensors file and views tensors straight out of the
mapping (no intermediate copy), so loading costs one copy into the model's parameters:
close to the raw memory-copy floor (``bench/weight_sync.py`` measures the ratio).
Names and shapes are checked against the model *before* any parameter is touched, so
a bad checkpoint leaves the served weights intact.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from primerl.errors import PrimerlError

__all__ = ["Adopted", "WeightsError", "adopt", "apply", "iter_safetensors", "pair", "safetensors_files", "stage",
           "write_safetensors"]

DTYPES = {
    "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class WeightsError(PrimerlError):
    """A checkpoint that cannot be loaded into the served model."""


def safetensors_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint directory (or a single file)."""
    p = Path(path)
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise WeightsError(f"weights path '{p}' does not exist")
    index = p / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [p / s for s in shards]
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"'{p}' holds no *.safetensors files (expected an HF checkpoint directory)")
    return files


def iter_safetensors(path: str | Path, writable: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) views into the memory-mapped file(s); no copies are made."""
    for file in safetensors_files(path):
        with open(file, "r+b" if writable else "rb") as f:
            # private + writable: tensors may become parameters that are later written in
            # place (copy-on-write keeps the file and the trainer's view untouched)
            if writable:
                mm = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            else:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        (header_len,) = struct.unpack("<Q", mm[:8])
        header = json.loads(mm[8 : 8 + header_len])
        base = 8 + header_len
        buf = memoryview(mm)
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            start, end = meta["data_offsets"]
            dtype = DTYPES[meta["dtype"]]
            if end == start:
                yield name, torch.empty(meta["shape"], dtype=dtype)
                continue
            with warnings.catch_warnings():  # read-only mapping: we only ever read from it
                warnings.simplefilter("ignore", UserWarning)
                flat = torch.frombuffer(buf[base + start : base + end], dtype=dtype)
            yield name, flat.view(meta["shape"])


def stage(model: torch.nn.Module, path: str | Path, strict: bool = True,
          writable: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Map a checkpoint and pair each tensor with the parameter it replaces; nothing is copied.

    Everything that can fail (missing file, unknown or missing names, wrong shapes) fails
    here, before the served weights are touched. Run it outside the engine's step gap.
    ``writable`` maps copy-on-write, as :func:`adopt` needs.
    """
    tensors = dict(iter_safetensors(path, writable=writable))
    return pair(model, tensors, path, strict=strict)


def pair(model: torch.nn.Module, tensors: dict[str, torch.Tensor], source: str | Path, *, strict: bool = True,
         may_lack: tuple[str, ...] = (), target: str = "the served model") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``tensors`` (model names) paired with the parameters they replace, after every name and
    shape is checked (a :class:`WeightsError` naming what does not fit); ``may_lack``: names
    the checkpoint may leave out (a tied head)."""
    targets = dict(model.state_dict(keep_vars=True))
    unknown = sorted(set(tensors) - set(targets))
    missing = sorted(set(targets) - set(tensors) - set(may_lack)) if strict else []
    bad_shape = [n for n, t in tensors.items() if n in targets and tuple(t.shape) != tuple(targets[n].shape)]
    if unknown or missing or bad_shape:
        parts = []
        if unknown:
            parts.append(f"{len(unknown)} unknown tensor(s), e.g. {unknown[:3]}")
        if missing:
            parts.append(f"{len(missing)} missing tensor(s), e.g. {missing[:3]}")
        if bad_shape:
            n = bad_shape[0]
            parts.append(f"shape mismatch for {n}: {tuple(tensors[n].shape)} vs {tuple(targets[n].shape)}")
        raise WeightsError(f"checkpoint '{source}' does not fit {target}: " + "; ".join(parts))
    return [(targets[name], t) for name, t in tensors.items()]  # the Parameter/buffer itself


def apply(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """Copy staged tensors into their parameters (the only part that needs the step gap)."""
    copied = 0
    with torch.no_grad():
        for dst, src in pairs:
            dst.copy_(src)
            copied += src.numel() * src.element_size()
    return copied


@dataclass
class Adopted:
    """What :func:`adopt` did: the bytes it had to copy (tensors it could not adopt) and the
    tensors the parameters held before. The old weights' memory (the previous mapping, or
    the weights the model was built with) is freed when this record is dropped (tens of ms
    for a few hundred MiB): the embedded engine hands it back to the thread that asked for
    the update and drops it there, so that freeing is no part of its step gap."""

    copied: int
    replaced: list[torch.Tensor] = field(repr=False)


def adopt(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Adopted:
    """Point parameters at the mapped tensors instead of copying (same-machine CPU serving).

    The co-located channel at its floor: the update is a pointer swap per tensor, and the
    pages are shared with the file in /dev/shm (no second copy of the weights in RAM).
    Tensors that cannot be adopted (other dtype or device, or storage shared by several
    parameters) are copied. Needs ``stage(..., writable=True)``.
    """
    shared: dict[int, int] = {}
    for dst, _ in pairs:
        shared[dst.data_ptr()] = shared.get(dst.data_ptr(), 0) + 1
    done = Adopted(copied=0, replaced=[])
    with torch.no_grad():
        for dst, src in pairs:
            if dst.dtype == src.dtype and dst.device.type == "cpu" and shared[dst.data_ptr()] == 1:
                done.replaced.append(dst.data)  # kept: freeing it here would lengthen the step gap
                dst.data = src
            else:
                dst.copy_(src)
                done.copied += src.numel() * src.element_size()
    return done


def write_safetensors(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """Write one safetensors file atomically (write to a temp name, then rename)."""
    from safetensors.torch import save_file

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
    os.replace(tmp, path)
