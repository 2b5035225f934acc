"""The ``memory`` KV store: idle prefixes stay in the engine's free KV slots, LRU.

A finished sequence's slot already holds the KV of everything it ran; keeping it costs
nothing but the slot. So this store keeps finished slots as they are, serves the longest
matching one to a new sequence (handing the slot over when the sequence lands in it,
copying the prefix otherwise), moves an idle prefix aside when the engine needs its slot
for the running batch (slots stay compact), and evicts the least recently used prefix
when no slot is free. A weight update clears it. It implements
:class:`primerl.kv_stores.KVStore`; no torch is imported here (the cache copies through
the :class:`primerl.kv_stores.SlotPool`).

It reports what it evicts (:class:`primerl.kv_stores.ReportsEvictions`: ``on_evict``), so it
is also the idle tier other stores put in front of their blocks
(:class:`primerl.kv_blocks.TieredKVStore`): ``disk`` and ``mooncake`` build it through the
registry (``get_registry().load("kv_store", "memory")``), as the engine does for its default.
Under ``--inference.backend vllm`` vLLM's own prefix cache does its job
(``vllm_prefix_cache`` in its registration).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from typing import Any

from primerl.kv_stores import IN_PROCESS, HandoffUnavailable, PrefixHit, SlotPool

__all__ = ["MemoryStore", "common_prefix"]


class _Entry:
    __slots__ = ("id", "slot", "tokens", "routed")

    def __init__(self, id: int, slot: int, tokens: list[int], routed: list[Any]) -> None:
        self.id, self.slot, self.tokens, self.routed = id, slot, tokens, routed


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists: slice comparisons (C speed)
    and a binary search, not a Python loop over tokens."""
    n = min(len(a), len(b))
    if n == 0 or a[0] != b[0]:
        return 0
    if a[:n] == b[:n]:
        return n
    lo, hi = 1, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class MemoryStore:
    """Idle prefixes kept in the engine's free KV slots, least recently used evicted first.

    ``on_evict(slot, tokens, routed)``, when set, is called for each prefix evicted to make
    room, while it is still in its slot (a weight update's :meth:`clear`, a prefix moved to
    another slot and a running sequence taking a prefix's slot over are not evictions).
    """

    current_weights_only = False  # a prefix that ran across a weight update is kept, as vLLM's prefix cache does

    def __init__(self) -> None:
        self.on_evict: Callable[[int, Sequence[int], list[Any]], None] | None = None
        self.pool: SlotPool | None = None
        self._lru: OrderedDict[int, _Entry] = OrderedDict()  # entry id -> entry, least recent first
        self._by_slot: dict[int, _Entry] = {}
        self._ids = itertools.count()

    # ---- KVStore --------------------------------------------------------------------------
    def bind(self, pool: SlotPool) -> None:
        self.pool = pool

    def lookup(self, tokens: Sequence[int]) -> PrefixHit | None:
        tokens = list(tokens)
        best, best_len = None, 0
        for e in self._lru.values():
            n = common_prefix(e.tokens, tokens)
            if n > best_len:
                best, best_len = e, n
        return PrefixHit(best_len, best.slot, best) if best is not None else None

    def load(self, hit: PrefixHit, slot: int, n: int) -> list[Any]:
        e: _Entry = hit.handle
        routed = _take_rows(e.routed, n)
        if e.slot == slot:  # the running sequence takes the slot over
            self._drop(e)
        else:
            self.pool.copy(e.slot, slot, n)
            self._lru.move_to_end(e.id)
        return routed

    def vacate(self, slot: int, keep: PrefixHit | None = None) -> None:
        e = self._by_slot.get(slot)
        if e is None:
            return
        if not self.pool.free:  # make room: the least recently used entry other than ``keep`` goes
            kept = keep.handle if keep is not None else None
            victim = next(v for v in self._lru.values() if v is not kept)  # ``e`` itself qualifies
            if self.on_evict is not None:
                self.on_evict(victim.slot, victim.tokens, victim.routed)
            self._drop(victim)
            self.pool.release(victim.slot)
            if victim is e:
                return
        dst = min(self.pool.free)
        self.pool.copy(slot, dst, len(e.tokens))
        self.pool.acquire(dst)
        del self._by_slot[slot]
        e.slot = dst
        self._by_slot[dst] = e
        self.pool.release(slot)

    def keep(self, slot: int, tokens: Sequence[int], routed: list[Any]) -> None:
        old = self._by_slot.get(slot)
        if old is not None:  # cannot happen through the engine; keep the books straight anyway
            self._drop(old)
        e = _Entry(next(self._ids), slot, list(tokens), list(routed))
        self._lru[e.id] = e
        self._by_slot[slot] = e

    def clear(self) -> None:
        for e in list(self._lru.values()):
            self._drop(e)
            self.pool.release(e.slot)

    def slots(self) -> Collection[int]:
        return self._by_slot.keys()

    def handoff_blocks(self) -> Any:
        raise HandoffUnavailable(f"this server's KV store ({type(self).__name__}) {IN_PROCESS}")

    # ---- internals ------------------------------------------------------------------------
    def _drop(self, e: _Entry) -> None:
        """Forget ``e`` (its slot is not released: the caller decides)."""
        del self._lru[e.id]
        del self._by_slot[e.slot]


def _take_rows(chunks: list[Any], n: int) -> list[Any]:
    """The first n rows of a list of [rows, ...] chunks."""
    out, left = [], n
    for c in chunks:
        if left <= 0:
            break
        part = c[:left]
        out.append(part)
        left -= len(part)
    return out
