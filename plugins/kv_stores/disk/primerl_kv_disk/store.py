"""The ``disk`` KV store: idle prefixes in free KV slots, evicted ones in files, restored on a hit.

What and why. The memory store keeps a finished sequence's KV where it was computed, in a
free slot of the engine's cache, and loses it when the slot is needed: the next turn of
that episode, or the next group with that system prompt, recomputes the whole prefix.
This store keeps the same idle tier (it *is* the memory store, built through the registry,
which reports its evictions), and when it evicts a prefix, writes the prefix's KV to
files first, as blocks of ``block_size`` tokens keyed by their token prefix
(:func:`primerl.kv_blocks.block_keys`), each with the routed experts of its tokens. A
later prompt that starts with those blocks gets them read back into its slot instead of
recomputed (:class:`primerl.kv_blocks.TieredKVStore` does the composing,
:class:`primerl.kv_blocks.BlockSlotStore` the cutting and assembling). The directory is
bounded (``max_bytes``); least recently used blocks are deleted first.

Write-back, not write-through: blocks are written when a prefix is evicted, not when a
sequence finishes, so a prefix that is reused while idle, or dropped by a weight update,
costs no I/O. A weight update writes nothing (that KV is stale) and deletes nothing: the
new version's keys never match the old blocks, which are then the least recently used
and go first.

Settings: the constructor's keyword arguments, ``[inference.kv_store_options]`` (typed config
keys, compared on resume); under prefill/decode the launcher's run service sets ``root`` and
``shared`` for every server through the run-time record (:mod:`primerl.runtime`):

* ``root`` (default the system temp dir): where the store makes its own directory
  ``primerl-kv-XXXX``, deleted when the process exits. It reads only files it wrote itself:
  KV in a file left by another process may come from other weights.
* ``shared`` (default false): use ``root`` itself, shared with the other servers of the run
  on this machine or a shared filesystem (each finds the blocks any of them wrote;
  prefill/decode disaggregation hands KV over this way). One run per directory (a run's
  output dir ``kv/``): keys do not name the run unless ``namespace`` does.
* ``max_bytes`` (default 8 GiB): the total size of the files this process wrote.
* ``block_size`` (default 64 tokens): a hit covers whole blocks (the rest of the prompt
  runs), one file per block.
* ``namespace`` (default empty): prepended to every key.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from primerl.kv_blocks import BlockSlotStore, TieredKVStore, decode_block, encode_block
from primerl.kv_stores import HandoffUnavailable, KVBlock, ServiceSite
from primerl.registry import get_registry

__all__ = ["DiskBlocks", "DiskStore", "SharedFolder", "run_service"]

DEFAULT_MAX_BYTES = 8 << 30
DEFAULT_BLOCK_SIZE = 64


class DiskBlocks:
    """A :class:`primerl.kv_stores.BlockKVStore` in a directory: one file per block
    (:func:`primerl.kv_blocks.encode_block`), at most ``max_bytes`` of them written by this
    process, its least recently used deleted first.

    Private (default): a new directory ``primerl-kv-XXXX`` under ``root``, this process's
    own, deleted when it exits; its index lives in memory. ``shared=True``: ``root`` itself,
    which other processes (the servers of one run) read and write too: a block any of them
    wrote is found by its file, files are written under a temporary name and renamed into
    place (a reader never sees half a block), and each process bounds and deletes (at exit)
    only the files it wrote. Give a shared directory to one run only: the keys name the
    model and the policy version, not the run.
    """

    def __init__(self, root: str | os.PathLike | None = None, max_bytes: int = DEFAULT_MAX_BYTES,
                 block_size: int = DEFAULT_BLOCK_SIZE, *, shared: bool = False) -> None:
        if max_bytes < 1 or block_size < 1:
            raise ValueError(f"max_bytes and block_size must be >= 1, got {max_bytes} and {block_size}")
        if shared and root is None:
            raise ValueError("a shared KV directory must be named: kv_store_options root = DIR")
        if root is not None:
            Path(root).mkdir(parents=True, exist_ok=True)
        self.shared = shared
        self.dir = Path(root) if shared else Path(tempfile.mkdtemp(prefix="primerl-kv-", dir=root))
        self.max_bytes, self.block_size = max_bytes, block_size
        self.bytes = 0
        self._lru: OrderedDict[str, int] = OrderedDict()  # key -> file size of what this process wrote, least recent first
        self._subdirs: set[str] = set()
        if shared:
            self._cleanup = weakref.finalize(self, _unlink_all, self.dir, self._lru)
        else:
            self._cleanup = weakref.finalize(self, shutil.rmtree, self.dir, ignore_errors=True)

    def _path(self, key: str) -> Path:
        return self.dir / key[:2] / key

    def _has(self, key: str) -> bool:
        return key in self._lru or (self.shared and self._path(key).exists())

    def contains(self, keys: Sequence[str]) -> int:
        n = 0
        for k in keys:
            if not self._has(k):
                break
            n += 1
        return n

    def get(self, keys: Sequence[str]) -> list[KVBlock | None]:
        out: list[KVBlock | None] = []
        for k in keys:
            if not self._has(k):
                out.append(None)
                continue
            try:
                block = decode_block(self._path(k).read_bytes())
            except (OSError, ValueError):  # deleted or damaged under us: a miss, and forgotten
                if k in self._lru:
                    self._forget(k)
                out.append(None)
                continue
            if k in self._lru:
                self._lru.move_to_end(k)
            out.append(block)
        return out

    def put(self, blocks: Sequence[KVBlock]) -> None:
        for b in blocks:
            if self._has(b.key):
                continue
            data = encode_block(b)
            if len(data) > self.max_bytes:
                continue
            sub = b.key[:2]
            if sub not in self._subdirs:
                (self.dir / sub).mkdir(exist_ok=True)
                self._subdirs.add(sub)
            path = self._path(b.key)
            if self.shared:  # renamed into place: another process never reads half a block
                tmp = path.with_name(f".{path.name}.{os.getpid()}")
                tmp.write_bytes(data)
                os.replace(tmp, path)
            else:
                with open(path, "wb") as f:
                    f.write(data)
            self._lru[b.key] = len(data)
            self.bytes += len(data)
            while self.bytes > self.max_bytes:
                self._forget(next(iter(self._lru)))

    def __len__(self) -> int:
        """Blocks this process wrote and still holds."""
        return len(self._lru)

    def close(self) -> None:
        """Delete this process's files now (the private directory with them; also done at exit)."""
        self._cleanup()
        self._lru.clear()
        self.bytes = 0

    def _forget(self, key: str) -> None:
        self.bytes -= self._lru.pop(key)
        try:
            self._path(key).unlink()
        except OSError:
            pass


def _unlink_all(root: Path, keys: OrderedDict) -> None:
    for k in list(keys):
        try:
            (root / k[:2] / k).unlink()
        except OSError:
            pass


class DiskStore(TieredKVStore):
    """Idle prefixes in free KV slots (the memory store); evicted ones written to files as
    blocks (LRU, at most ``max_bytes``) and restored on a prefix hit."""

    def __init__(self, root: str | os.PathLike | None = None, max_bytes: int | None = None,
                 block_size: int | None = None, *, shared: bool = False, namespace: str = "") -> None:
        max_bytes = max_bytes if max_bytes is not None else DEFAULT_MAX_BYTES
        block_size = block_size if block_size is not None else DEFAULT_BLOCK_SIZE
        self.files = DiskBlocks(root, max_bytes, block_size, shared=shared)
        idle = get_registry().load("kv_store", "memory")()  # reports what it evicts: written out then
        super().__init__(idle, self.files, write_through=False, namespace=namespace)

    def handoff_blocks(self) -> BlockSlotStore:
        if not self.files.shared:
            raise HandoffUnavailable(
                "this server's disk KV store keeps its blocks in a directory of its own, which other servers never "
                "read: give every server of the run one folder, inference.kv_store_options root = DIR and shared = "
                "true (the launchers do under prefill/decode)")
        return self.blocks


class SharedFolder:
    """The disk store's run service: under prefill/decode the servers of a run share one
    folder (a decode server loads what a prefill server wrote)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def options(self) -> dict[str, Any]:
        return {"root": str(self.root), "shared": True}

    def describe(self) -> None:
        return None

    def alive(self) -> None:
        return None  # a folder: nothing runs

    def stop(self) -> None:
        pass


def run_service(cfg: Any, site: ServiceSite) -> SharedFolder | None:
    """:class:`SharedFolder` for a prefill/decode run whose ``kv_store_options`` name no folder:
    ``OUT/kv``, or ``OUT/kv/disk-<launch>`` for a named launch (a Slurm job: a requeued job
    never reads what the last one's servers left)."""
    if not cfg.inference.disaggregated() or cfg.inference.kv_store_options.get("root"):
        return None
    kv = site.run_dir.root / "kv"
    return SharedFolder(kv / f"disk-{site.launch}" if site.launch else kv)
