"""The ``mooncake`` KV store: KV blocks in a Mooncake Store pool shared by every inference server.

What and why. With several inference servers behind a router, a prefix computed on one
(a multi-turn episode's earlier turns, a group's prompt, a shared system prompt) is
recomputed on every other that sees it. Mooncake Store (the KV pool of Kimi's serving
stack) is a distributed object store over the memory each client lends it, moved by its
transfer engine (TCP here; RDMA where there is a NIC for it). This store writes every
finished sequence's new full blocks into that pool at once (write-through), keyed by their
token prefix under the model and policy version (:func:`primerl.kv_blocks.block_keys`),
each with the routed experts of its tokens, and on a prompt restores the longest run of
blocks the pool holds, whichever server computed them. Idle prefixes also stay in this
server's free slots (the memory store), which serve first when they cover as much.
:class:`primerl.kv_blocks.TieredKVStore` does the composing,
:class:`primerl.kv_blocks.BlockSlotStore` the cutting and assembling; the idle tier is the
``memory`` store, built through the registry.

Stale KV: block keys carry the policy version, so after a weight update every server
misses the old blocks (Mooncake evicts them as the pool fills); a sequence that ran across
an update is never written (``current_weights_only``).

Settings: the constructor's keyword arguments, ``[inference.kv_store_options]`` (typed config
keys, compared on resume); what a launcher's run service discovers (the master it started)
comes through the run-time record (:mod:`primerl.runtime`) on top of them:

* ``master`` (required): ``host:port`` of the master's RPC service; the launchers start one
  per run (:func:`primerl_kv_mooncake.master.run_service`) unless this names one.
* ``metadata`` (default ``P2PHANDSHAKE``: clients exchange their transfer metadata directly,
  no metadata server): or the master's HTTP metadata server, ``http://host:port/metadata``
  (:attr:`~primerl_kv_mooncake.master.MooncakeMaster.metadata_url`). Every client of one pool
  must use the same: a P2P client cannot read an HTTP one's memory.
* ``local_host`` (default 127.0.0.1 when the master is on this machine, else this
  machine's address on its route to the master): the address other clients reach this one at.
* ``segment_bytes`` (default 4 GiB): memory this server lends the pool (allocated as it
  fills); ``buffer_bytes`` (default 256 MiB): its transfer buffer (one get or put moves at
  most this much).
* ``protocol`` (default ``tcp``; ``rdma`` with ``device``).
* ``block_size`` (default 64 tokens).
* ``namespace`` (default empty): prepended to every key, for runs that share one master.
"""

from __future__ import annotations

import socket
import urllib.parse
import weakref
from collections.abc import Sequence

from primerl.kv_blocks import TieredKVStore, decode_block, encode_block
from primerl.kv_stores import KVBlock
from primerl.registry import get_registry
from primerl_kv_mooncake.install import MooncakeUnavailable, import_store

__all__ = ["MooncakeBlocks", "MooncakeStore"]

DEFAULT_BLOCK_SIZE = 64
DEFAULT_SEGMENT_BYTES = 4 << 30
DEFAULT_BUFFER_BYTES = 256 << 20


class MooncakeBlocks:
    """A :class:`primerl.kv_stores.BlockKVStore` in a Mooncake Store pool: one object per block
    (:func:`primerl.kv_blocks.encode_block`), keyed by the block key. This client lends the
    pool ``segment_bytes``; what it puts may land in any client's memory, and every client
    of the same master sees it. Eviction is the master's (as the pool fills)."""

    def __init__(self, master: str, metadata: str = "P2PHANDSHAKE", *, local_host: str = "127.0.0.1", segment_bytes: int = DEFAULT_SEGMENT_BYTES,
                 buffer_bytes: int = DEFAULT_BUFFER_BYTES, protocol: str = "tcp", device: str = "",
                 block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        store_cls = import_store()
        self.block_size, self.buffer_bytes = block_size, buffer_bytes
        self.master, self.metadata = master, metadata
        hint = "is a master serving there? `python -m primerl_kv_mooncake.master` starts one and prints its address"
        checks = [("master", master)]
        if metadata.startswith("http"):
            checks.append(("metadata server", urllib.parse.urlsplit(metadata).netloc))
        for what, address in checks:
            if not _reachable(address):  # Mooncake itself retries for about 90 s before it gives up
                raise MooncakeUnavailable(f"cannot reach the Mooncake {what} at {address}: {hint}")
        self._store = store_cls()
        rc = self._store.setup(local_host, metadata, segment_bytes, buffer_bytes, protocol, device, master)
        if rc != 0:
            raise MooncakeUnavailable(f"cannot join the Mooncake pool (master {master}, metadata {metadata}; "
                                      f"setup returned {rc}): {hint}")
        self._close = weakref.finalize(self, self._store.close)
        self._block_bytes = 0  # size of one encoded block, once seen: how many fit the transfer buffer
        self.failed_puts = 0

    def _per_call(self) -> int:
        """Blocks one get or put may move: half the transfer buffer's worth (1 until a block's
        size is known: Mooncake fails the items of a batch that do not fit its buffer)."""
        return max(1, (self.buffer_bytes // 2) // self._block_bytes) if self._block_bytes else 1

    def contains(self, keys: Sequence[str]) -> int:
        if not keys:
            return 0
        n = 0
        for e in self._store.batch_is_exist(list(keys)):
            if e != 1:
                break
            n += 1
        return n

    def get(self, keys: Sequence[str]) -> list[KVBlock | None]:
        out: list[KVBlock | None] = []
        keys, at = list(keys), 0
        while at < len(keys):
            batch = keys[at:at + self._per_call()]
            at += len(batch)
            for data in self._store.get_batch(batch):
                if not data:  # missing, evicted, or its owner left the pool
                    out.append(None)
                    continue
                self._block_bytes = max(self._block_bytes, len(data))
                try:
                    out.append(decode_block(data))
                except ValueError:
                    out.append(None)
        return out

    def put(self, blocks: Sequence[KVBlock]) -> None:
        encoded = [(b.key, encode_block(b)) for b in blocks]
        if not encoded:
            return
        self._block_bytes = max(self._block_bytes, max(len(d) for _, d in encoded))
        per = self._per_call()
        for batch in (encoded[i:i + per] for i in range(0, len(encoded), per)):
            rc = self._store.put_batch([k for k, _ in batch], [d for _, d in batch])
            if rc != 0:  # pool full or a transfer failed: those blocks are not stored (a later miss)
                self.failed_puts += len(batch)

    def close(self) -> None:
        """Leave the pool (what this client lent goes with it). Also done at exit."""
        self._close()


def _reachable(address: str, timeout: float = 3.0) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def _is_local(host: str) -> bool:
    return host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")


def address_towards(host: str) -> str:
    """This machine's address on its route to ``host`` (the master): what the pool's other
    clients, on other nodes, reach this one at. Not the hostname, which a node's own
    ``/etc/hosts`` may map to a loopback address (Debian's 127.0.1.1); no packet is sent."""
    try:
        family, _, _, _, where = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(where)
            return str(s.getsockname()[0])
    except OSError:  # no route known here: the name, as the master's other clients may resolve it
        return socket.gethostname()


class MooncakeStore(TieredKVStore):
    """KV blocks in a Mooncake Store pool shared by every inference server of a run (written
    when a sequence finishes, restored on a prefix hit on any server); idle prefixes also in
    this server's free KV slots. Settings: see the module docstring."""

    def __init__(self, master: str | None = None, metadata: str | None = None, *, local_host: str | None = None,
                 segment_bytes: int | None = None, buffer_bytes: int | None = None, protocol: str | None = None,
                 device: str = "", block_size: int | None = None, namespace: str | None = None) -> None:
        if not master:
            raise MooncakeUnavailable(
                "the mooncake KV store needs a Mooncake master: start the run with a launcher (it starts one), or "
                "set inference.kv_store_options.master = \"host:port\" (`python -m primerl_kv_mooncake.master` "
                "starts one and prints it)")
        host = master.rsplit(":", 1)[0]
        metadata = metadata or "P2PHANDSHAKE"
        if local_host is None:
            local_host = "127.0.0.1" if _is_local(host) else address_towards(host)
        self.pool_blocks = MooncakeBlocks(
            master, metadata, local_host=local_host, segment_bytes=segment_bytes or DEFAULT_SEGMENT_BYTES,
            buffer_bytes=buffer_bytes or DEFAULT_BUFFER_BYTES, protocol=protocol or "tcp", device=device,
            block_size=block_size or DEFAULT_BLOCK_SIZE,
        )
        namespace = namespace or ""
        super().__init__(get_registry().load("kv_store", "memory")(), self.pool_blocks, write_through=True,
                         namespace=namespace)

    def close(self) -> None:
        self.pool_blocks.close()
