"""KV stores: where an inference engine keeps the keys and values of prefixes it may see again.

What and why. RL traffic repeats prefixes all the time: the ``n`` samples of a group share
their prompt, a multi-turn episode resends every earlier turn at each new turn, an agent
env reruns the same long system prompt. Recomputing such a prefix costs a prefill;
keeping its KV costs memory. A KV store decides which prefixes are kept, where, and for
how long. The engine asks it, at admission, how much of a prompt it holds; hands it every
finished sequence ("keep this if you want it"); tells it when it needs a cache slot back;
and tells it when the weights change (everything held is then stale: KV computed by the
old policy must not serve the new one).

Two levels of the same idea live here:

* :class:`KVStore`, **what the embedded engine calls today**: one engine, one slot cache
  (the engine's KV cache is a fixed number of slots, one sequence each, see
  :class:`primerl.models.batch.SlotCache`). The store sees that cache through a
  :class:`SlotPool`. The ``memory`` plugin (``plugins/kv_stores/memory``) is its only
  implementation: idle prefixes stay where they were computed, in free slots of the
  engine's cache, least recently used evicted first. A store that offloads to host memory
  or disk implements the same protocol, copying out in :meth:`KVStore.keep` and back in
  :meth:`KVStore.load`.
* :class:`BlockKVStore`, **the next step, not implemented yet**: a store shared by several
  inference servers (Mooncake Store's distributed pool), holding fixed-size KV blocks keyed
  by the hash of the token prefix that ends with them (:func:`block_keys`), each block with
  the routed-expert ids of its tokens, so that router replay (R3) still has every token's
  experts when that token's KV came from another server or back from offload. It is the
  block-level ``put``/``get``/``contains`` interface such a store implements; a slot-level
  :class:`KVStore` would adapt it to the engine (cut a finished slot into blocks on
  ``keep``, assemble the matching blocks into a slot on ``load``). Nothing implements it
  today: the memory store is the only KV store.

Who calls what, and when: only the engine's thread, between two forwards, calls a
:class:`KVStore` (never an HTTP handler), so implementations need no locks. Nothing here is
called per decoded token: lookups happen once per admitted sequence, ``keep`` once per
finished one.

This module imports nothing heavy (no torch): plugin modules and ``primerl plugins list``
may import it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Sequence
from typing import Any, Protocol

import attrs


class KVCache(Protocol):
    """What a KV store may do to the engine's KV cache (a :class:`primerl.models.batch.SlotCache`)."""

    def copy_prefix(self, src_slot: int, dst_slot: int, n: int) -> None:
        """Copy the first ``n`` cached positions of ``src_slot`` into ``dst_slot``."""


class SlotPool:
    """The engine's KV cache as a store sees it: ``num_slots`` slots and the set of free ones.

    A slot is in exactly one of three states: *free* (in :attr:`free`), *running* (holds a
    sequence the engine is generating; the engine owns it) or *held* by the store (an idle
    cached prefix; :meth:`KVStore.slots`). The engine takes a slot with :meth:`acquire`;
    whoever owns a slot gives it back with :meth:`release`.
    """

    def __init__(self, cache: KVCache, num_slots: int) -> None:
        self.cache = cache
        self.num_slots = num_slots
        self.free: set[int] = set(range(num_slots))

    def acquire(self, slot: int) -> None:
        """Take ``slot`` out of the free set (it must be free: see :meth:`KVStore.vacate`)."""
        self.free.discard(slot)

    def release(self, slot: int) -> None:
        """Give ``slot`` back: its contents are garbage from now on."""
        self.free.add(slot)

    def copy(self, src: int, dst: int, n: int) -> None:
        """Copy the first ``n`` positions of slot ``src`` into slot ``dst``."""
        self.cache.copy_prefix(src, dst, n)


@attrs.frozen
class PrefixHit:
    """A stored prefix that matches the start of a prompt (:meth:`KVStore.lookup`).

    ``length``: how many leading tokens of the prompt it covers (>= 1).
    ``slot``: the engine cache slot that holds it now, or None when it lives outside the
    engine's cache and :meth:`KVStore.load` must bring it in.
    ``handle``: the store's own reference to the entry; the engine only hands it back.
    """

    length: int
    slot: int | None
    handle: Any = None


class KVStore(Protocol):
    """A per-engine KV store: finds, keeps and evicts cached prefixes for the embedded engine.

    The registered target (``register_kv_stores``) is a class or factory called with no
    arguments; the engine then calls :meth:`bind` once and the other methods from its own
    thread. Routed experts travel with the KV: ``routed`` is a list of chunks, each
    ``[tokens, moe_layers, top_k]`` (a torch tensor; an empty list for dense models), in
    token order, covering exactly the stored tokens, so a sequence that reuses a prefix
    still reports every token's experts (router replay).

    The engine's admission of a sequence into ``slot`` with a hit ``h`` of ``n`` tokens is::

        if h.slot == slot:  routed = store.load(h, slot, n)       # the prefix is already there
        else:               store.vacate(slot, keep=h); pool.acquire(slot); routed = store.load(h, slot, n)

    and without a hit: ``store.vacate(slot, keep=None); pool.acquire(slot)``.
    """

    def bind(self, pool: SlotPool) -> None:
        """Called once, before anything else: the cache this store serves."""

    def lookup(self, tokens: Sequence[int]) -> PrefixHit | None:
        """The stored prefix sharing the most leading tokens with ``tokens`` (None: none
        shares even the first). Must not change what is stored."""

    def load(self, hit: PrefixHit, slot: int, n: int) -> list[Any]:
        """Make ``slot`` hold the KV of the first ``n`` (1 <= n <= ``hit.length``) tokens of
        ``hit`` and return those tokens' routed-expert chunks. ``slot`` is either
        ``hit.slot`` (the store hands that slot over to the running sequence and forgets the
        entry) or a slot the engine has just acquired (the store copies into it and keeps
        the entry, now most recently used)."""

    def vacate(self, slot: int, keep: PrefixHit | None = None) -> None:
        """The engine is about to acquire ``slot``: if the store holds it, move what is there
        to another free slot or drop it (evicting something else when no slot is free), and
        leave ``slot`` free. Never evicts ``keep``. A store that holds no engine slot does
        nothing."""

    def keep(self, slot: int, tokens: Sequence[int], routed: list[Any]) -> None:
        """A finished sequence's slot, holding the KV of ``tokens`` (its prompt and output
        as far as they were run) and their routed experts. The store owns ``slot`` from now
        on: it keeps the slot (memory store), or copies the KV out and releases it, or just
        releases it."""

    def clear(self) -> None:
        """Forget everything (the weights changed) and release every slot held."""

    def slots(self) -> Collection[int]:
        """The engine slots the store holds now (idle prefixes: neither free nor running)."""


# ---- the shared, block-level store (the next step: nothing implements it yet) -------------


def block_keys(tokens: Sequence[int], block_size: int, namespace: str) -> list[str]:
    """Content keys of the full ``block_size`` blocks of ``tokens``, as a shared store names them.

    Key ``i`` is a chained hash: it covers ``namespace`` and every token up to the end of
    block ``i``, so two sequences share key ``i`` exactly when they share that whole
    prefix (vLLM's and SGLang's prefix caches, and Mooncake's connectors, key blocks the same
    way). ``namespace`` must name everything else the KV depends on: the model and the
    policy version (``"glm5@v12"``): after a weight update, every old block simply misses.
    A trailing partial block has no key (it is recomputed, not shared).
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    keys, parent = [], hashlib.blake2b(namespace.encode(), digest_size=16).digest()
    for start in range(0, len(tokens) - block_size + 1, block_size):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(b"".join(int(t).to_bytes(4, "little", signed=False) for t in tokens[start:start + block_size]))
        parent = h.digest()
        keys.append(parent.hex())
    return keys


@attrs.frozen
class KVBlock:
    """One block of a shared store: the KV of ``block_size`` consecutive tokens after a prefix.

    ``key``: :func:`block_keys` of the prefix ending with this block.
    ``tokens``: the block's token ids (a reader checks them: a hash collision is a miss).
    ``kv``: per cache tensor name (the model's ``cache_layout``, e.g. ``"k"``/``"v"`` per
    layer, or MLA's latent), a tensor ``[block_size, ...]`` of that layer's entries.
    ``routed_experts``: ``[block_size, moe_layers, top_k]`` expert ids that produced these
    tokens' hidden states (None for a dense model). Stored with the KV because a token whose
    KV is reused is never run again: without them, router replay would lose its experts.
    ``policy_version``: the weights that computed the block (also folded into ``key``).
    """

    key: str
    tokens: tuple[int, ...]
    kv: dict[str, Any]
    routed_experts: Any | None
    policy_version: int


class BlockKVStore(Protocol):
    """A KV store shared by several inference servers (Mooncake Store's pool): blocks by key.

    Not implemented yet; this is the interface a Mooncake (or Redis, or disk) plugin will
    implement, written down so the slot-level :class:`KVStore` that adapts it, and the
    routed-expert layout it must preserve, are fixed before the first one is written. Blocks
    are immutable once put (their key is their content's hash), so stores may replicate
    and evict them freely; eviction policy is the store's.
    """

    block_size: int

    def contains(self, keys: Sequence[str]) -> int:
        """How many of ``keys``, from the first, the store holds (the usable prefix length in
        blocks: a prefix is useful only up to its first missing block)."""

    def get(self, keys: Sequence[str]) -> list[KVBlock | None]:
        """The blocks for ``keys``, in order (None where a block is missing or was evicted
        since :meth:`contains`)."""

    def put(self, blocks: Sequence[KVBlock]) -> None:
        """Store ``blocks`` (a key already present is left as it is). May drop blocks when
        full; a later :meth:`get` then misses."""
