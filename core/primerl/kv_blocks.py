"""The block machinery KV store plugins share: block keys, the block codec, and the adapters
that put a block store behind the embedded engine.

A block store (:class:`primerl.kv_stores.BlockKVStore`: files for ``disk``, Mooncake
Store's pool for ``mooncake``, any third party's) keeps fixed-size **blocks** of KV keyed by
the hash of the token prefix that ends with them (:func:`block_keys`, namespaced by the
model and the policy version), each with the routed-expert ids of its tokens, so that router
replay (R3) still has every token's experts when that token's KV came from another server or
back from offload. This module is what such a store builds on:

* :func:`block_keys`, :func:`encode_block` / :func:`decode_block`: a block's key and bytes;
* :class:`BlockSlotStore`: a :class:`primerl.kv_stores.KVStore` over a block store (cut a
  finished slot into blocks; on a hit, assemble the blocks into a slot); also the tier that
  prefill/decode hands KV over through (:meth:`primerl.kv_stores.KVStore.handoff_blocks`);
* :class:`TieredKVStore`: a block store behind an idle tier (the ``memory`` store): idle
  prefixes stay in free slots, and blocks are written when an idle prefix is evicted
  (write-back, ``disk``) or as soon as a sequence finishes (write-through, ``mooncake``:
  other servers can reuse it at once).

Stale KV never serves a new policy: block keys carry :attr:`primerl.kv_stores.SlotPool.namespace`
(the model's identity and the policy version), so after an update every old block misses
and ages out of its store; both tiered stores set ``current_weights_only``, so a sequence
that ran across an update (KV of two policies) is never published under the new keys.

Imports nothing heavy at import time (torch only inside the functions that move tensors).
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import warnings
from collections.abc import Collection, Sequence
from typing import Any

import attrs

from primerl.kv_stores import BlockKVStore, KVBlock, KVStore, PrefixHit, ReportsEvictions, SlotPool

__all__ = ["BlockSlotStore", "BlockStats", "TieredKVStore", "block_keys", "decode_block", "encode_block"]


def block_keys(tokens: Sequence[int], block_size: int, namespace: str) -> list[str]:
    """Content keys of the full ``block_size`` blocks of ``tokens``, as a block store names them.

    Key ``i`` is a chained hash: it covers ``namespace`` and every token up to the end of
    block ``i``, so two sequences share key ``i`` exactly when they share that whole
    prefix (vLLM's and SGLang's prefix caches, and Mooncake's connectors, key blocks the same
    way). ``namespace`` must name everything else the KV depends on: the model and the
    policy version (:attr:`SlotPool.namespace`, ``"Glm5ForCausalLM-3f2a...@v12"``): after a
    weight update, every old block simply misses. A trailing partial block has no key (it is
    recomputed, not stored).
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    n = len(tokens) // block_size
    if n == 0:
        return []
    # every token as 4 little-endian bytes, packed at once (not a Python loop per token)
    raw = struct.pack(f"<{n * block_size}I", *tokens[: n * block_size])
    step = 4 * block_size
    keys, parent = [], hashlib.blake2b(namespace.encode(), digest_size=16).digest()
    for i in range(n):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(raw[i * step:(i + 1) * step])
        parent = h.digest()
        keys.append(parent.hex())
    return keys


_MAGIC = b"PRKV\x01"
_ALIGN = 16  # every tensor starts at a multiple of this in an encoded block (dtype views need it)


def _pad(n: int) -> int:
    return -n % _ALIGN


def encode_block(block: KVBlock) -> bytes:
    """One block as bytes (a file's or a Mooncake object's content): a small JSON header
    (key, tokens, version, every tensor's name, dtype and shape) then the raw tensors.
    The tensors must be on the CPU."""
    import torch

    tensors = list(block.kv.items())
    if block.routed_experts is not None:
        tensors.append(("routed_experts", block.routed_experts))
    head = json.dumps({
        "key": block.key, "tokens": list(block.tokens), "policy_version": block.policy_version,
        "tensors": [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in tensors],
    }).encode()
    parts: list[Any] = [_MAGIC, struct.pack("<I", len(head)), head]
    used = len(_MAGIC) + 4 + len(head)
    parts.append(bytes(_pad(used)))
    for _, t in tensors:
        raw = t.detach().contiguous().view(-1).view(torch.uint8).numpy()
        parts.append(raw)
        parts.append(bytes(_pad(raw.nbytes)))
    return b"".join(parts)


def decode_block(data: bytes | bytearray | memoryview) -> KVBlock:
    """The block :func:`encode_block` wrote. Its tensors are views of ``data`` (read-only
    when ``data`` is bytes: copy before writing to them). Raises ValueError on bytes that
    are not a block."""
    import torch

    if bytes(data[: len(_MAGIC)]) != _MAGIC or len(data) < len(_MAGIC) + 4:
        raise ValueError("not a primerl KV block (bad magic)")
    (n_head,) = struct.unpack_from("<I", data, len(_MAGIC))
    at = len(_MAGIC) + 4
    head = json.loads(bytes(data[at:at + n_head]))
    at += n_head
    at += _pad(at)
    with warnings.catch_warnings():  # read-only buffers (bytes): the tensors are only read
        warnings.simplefilter("ignore", UserWarning)
        buf = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
    kv, routed = {}, None
    for name, dtype, shape in head["tensors"]:
        dt = getattr(torch, dtype)
        nbytes = math.prod(shape) * dt.itemsize
        if at + nbytes > len(data):
            raise ValueError("truncated primerl KV block")
        t = buf[at:at + nbytes].view(dt).view(shape)
        at += nbytes + _pad(nbytes)
        if name == "routed_experts":
            routed = t
        else:
            kv[name] = t
    return KVBlock(head["key"], tuple(head["tokens"]), kv, routed, head["policy_version"])


class _Fetched:
    """A :class:`BlockSlotStore` hit: the blocks, already fetched (a hit is exact: a block
    evicted between ``contains`` and ``get`` shortens the hit instead of failing the load)."""

    __slots__ = ("blocks",)

    def __init__(self, blocks: list[KVBlock]) -> None:
        self.blocks = blocks


@attrs.define
class BlockStats:
    """What a :class:`BlockSlotStore` moved (tests, benchmarks, logs)."""

    saved_blocks: int = 0  # blocks put into the block store
    restored_blocks: int = 0  # blocks written into engine slots on a hit
    restored_tokens: int = 0  # tokens of KV that came from blocks instead of a forward


class BlockSlotStore:
    """A :class:`KVStore` over a :class:`BlockKVStore`: the engine's slots, in blocks.

    * :meth:`keep` (and :meth:`save`): the finished slot's full blocks of ``block_size``
      tokens that the block store does not hold yet are read out of the slot
      (:meth:`SlotPool.read`) with their routed experts and put; the slot is released.
    * :meth:`lookup`: the keys of the prompt's full blocks (:func:`block_keys` under
      ``namespace/`` + :attr:`SlotPool.namespace`), the longest leading run the store holds,
      fetched at once (the hit is exactly what was fetched and checked: a block that is
      missing, evicted meanwhile, or whose tokens differ ends the run).
    * :meth:`load`: the blocks' tensors concatenated and written into the slot
      (:meth:`SlotPool.write`), their routed experts returned.

    It holds no engine slot, so :meth:`vacate` has nothing to do, and :meth:`clear` neither:
    the next keys carry the new version, and old blocks age out of the block store.
    """

    current_weights_only = True

    def __init__(self, blocks: BlockKVStore, namespace: str = "") -> None:
        self.blocks = blocks
        self.block_size = blocks.block_size
        self.namespace = namespace
        self.pool: SlotPool | None = None
        self.stats = BlockStats()

    def keys(self, tokens: Sequence[int]) -> list[str]:
        """The block keys of ``tokens`` under this store's namespace and the pool's."""
        return block_keys(tokens, self.block_size, f"{self.namespace}/{self.pool.namespace}")

    # ---- KVStore --------------------------------------------------------------------------
    def bind(self, pool: SlotPool) -> None:
        self.pool = pool

    def lookup(self, tokens: Sequence[int], longer_than: int = 0) -> PrefixHit | None:
        """Also the :class:`TieredKVStore`'s second tier: ``longer_than`` tokens are already
        covered (by an idle prefix), so nothing is fetched unless the blocks cover more."""
        bs = self.block_size
        keys = self.keys(tokens)
        if len(keys) * bs <= longer_than:
            return None
        n = self.blocks.contains(keys)
        if n * bs <= longer_than:
            return None
        run: list[KVBlock] = []
        for i, b in enumerate(self.blocks.get(keys[:n])):
            if (b is None or b.key != keys[i] or b.tokens != tuple(tokens[i * bs:(i + 1) * bs])
                    or (run and (b.routed_experts is None) != (run[0].routed_experts is None))):
                break
            run.append(b)
        if len(run) * bs <= longer_than:
            return None
        return PrefixHit(len(run) * bs, None, _Fetched(run))

    def load(self, hit: PrefixHit, slot: int, n: int) -> list[Any]:
        import torch

        blocks = hit.handle.blocks[: -(-n // self.block_size)]
        names = blocks[0].kv.keys()
        if len(blocks) == 1:
            kv = {name: blocks[0].kv[name][:n] for name in names}
        else:
            kv = {name: torch.cat([b.kv[name] for b in blocks])[:n] for name in names}
        self.pool.write(slot, 0, kv)
        self.stats.restored_blocks += len(blocks)
        self.stats.restored_tokens += n
        if blocks[0].routed_experts is None:
            return []
        # copies: views would keep every block's bytes (its KV too) alive with the sequence
        return [torch.cat([b.routed_experts for b in blocks])[:n]]

    def vacate(self, slot: int, keep: PrefixHit | None = None) -> None:
        pass

    def keep(self, slot: int, tokens: Sequence[int], routed: list[Any]) -> None:
        self.save(slot, tokens, routed)
        self.pool.release(slot)

    def clear(self) -> None:
        pass

    def slots(self) -> Collection[int]:
        return ()

    def handoff_blocks(self) -> BlockSlotStore:
        return self

    # ---- the write path -------------------------------------------------------------------
    def save(self, slot: int, tokens: Sequence[int], routed: list[Any]) -> int:
        """Put the full blocks of ``slot`` (holding the KV of ``tokens``) that the block store
        lacks; the slot is left as it is. Returns how many blocks were put. Nothing is put
        when ``routed`` does not cover every token (it must, or router replay would lose
        the experts of tokens served from these blocks)."""
        import torch

        bs = self.block_size
        keys = self.keys(tokens)
        if not keys:
            return 0
        have = self.blocks.contains(keys)
        if have == len(keys):
            return 0
        routed_all = None
        if routed:
            routed_all = torch.cat(list(routed)) if len(routed) > 1 else routed[0]
            if len(routed_all) != len(tokens):
                return 0
        start, stop = have * bs, len(keys) * bs
        kv = {name: t.to("cpu") for name, t in self.pool.read(slot, start, stop - start).items()}
        new = []
        for i in range(have, len(keys)):
            a, b = i * bs, (i + 1) * bs
            new.append(KVBlock(
                keys[i], tuple(tokens[a:b]), {name: t[a - start:b - start] for name, t in kv.items()},
                routed_all[a:b] if routed_all is not None else None, self.pool.version,
            ))
        self.blocks.put(new)
        self.stats.saved_blocks += len(new)
        return len(new)


class TieredKVStore:
    """Idle prefixes in free slots (``idle``, e.g. the memory store), blocks behind them.

    ``idle`` serves what it holds exactly as on its own; a prompt whose blocks cover more
    than the idle tier's best match is restored from the blocks (:class:`BlockSlotStore`).
    Blocks are written

    * ``write_through=True``: when a sequence finishes (:meth:`keep`), before the idle tier
      keeps the slot: other servers sharing the block store can reuse it at once (Mooncake);
    * ``write_through=False`` (write-back): when the idle tier evicts a prefix to make room
      (a weight update's :meth:`clear` writes nothing: that KV is stale). The idle tier must
      report evictions (:class:`ReportsEvictions`; this store sets its ``on_evict`` in
      :meth:`bind`).

    ``current_weights_only``: the engine never hands this store KV of two policies (see
    :class:`KVStore`), so both tiers hold only KV of the current weights.
    """

    current_weights_only = True

    def __init__(self, idle: KVStore, blocks: BlockKVStore, *, write_through: bool, namespace: str = "") -> None:
        if not write_through and not isinstance(idle, ReportsEvictions):
            raise TypeError(f"write-back needs an idle tier that reports evictions (ReportsEvictions: an on_evict "
                            f"attribute); {type(idle).__name__} has none")
        self.idle = idle
        self.blocks = BlockSlotStore(blocks, namespace)
        self.write_through = write_through

    @property
    def stats(self) -> BlockStats:
        return self.blocks.stats

    # ---- KVStore --------------------------------------------------------------------------
    def bind(self, pool: SlotPool) -> None:
        self.idle.bind(pool)
        self.blocks.bind(pool)
        if not self.write_through:
            self.idle.on_evict = self._spill

    def lookup(self, tokens: Sequence[int]) -> PrefixHit | None:
        near = self.idle.lookup(tokens)
        far = self.blocks.lookup(tokens, longer_than=near.length if near is not None else 0)
        return far if far is not None else near

    def load(self, hit: PrefixHit, slot: int, n: int) -> list[Any]:
        if isinstance(hit.handle, _Fetched):
            return self.blocks.load(hit, slot, n)
        return self.idle.load(hit, slot, n)

    def vacate(self, slot: int, keep: PrefixHit | None = None) -> None:
        self.idle.vacate(slot, keep=None if keep is None or isinstance(keep.handle, _Fetched) else keep)

    def keep(self, slot: int, tokens: Sequence[int], routed: list[Any]) -> None:
        if self.write_through:
            self.blocks.save(slot, tokens, routed)
        self.idle.keep(slot, tokens, routed)

    def clear(self) -> None:
        self.idle.clear()
        self.blocks.clear()

    def slots(self) -> Collection[int]:
        return self.idle.slots()

    def handoff_blocks(self) -> BlockSlotStore:
        return self.blocks

    def _spill(self, slot: int, tokens: Sequence[int], routed: list[Any]) -> None:
        self.blocks.save(slot, tokens, routed)
