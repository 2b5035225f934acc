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

* :class:`KVStore`, **what the embedded engine calls**: one engine, one slot cache (the
  engine's KV cache is a fixed number of slots, one sequence each, see
  :class:`primerl.models.batch.SlotCache`). The store sees that cache through a
  :class:`SlotPool`: which slots are free, copying a prefix from slot to slot, and reading
  and writing a span of positions (what an offloading store copies out and back in). The
  ``memory`` plugin (``plugins/kv_stores/memory``) keeps idle prefixes where they were
  computed, in free slots of the engine's cache, least recently used evicted first.
* :class:`BlockKVStore`, **a store of fixed-size KV blocks** keyed by the hash of the token
  prefix that ends with them (:func:`block_keys`, namespaced by the model and the policy
  version), each block with the routed-expert ids of its tokens, so that router replay
  (R3) still has every token's experts when that token's KV came from another server or
  back from offload. ``disk`` (``plugins/kv_stores/disk``: files, LRU within a size bound)
  and ``mooncake`` (``plugins/kv_stores/mooncake``: Mooncake Store's pool, shared by every
  inference server of a run) implement it. :class:`BlockSlotStore` adapts one to the
  engine (cut a finished slot into blocks; on a hit, assemble the blocks into a slot) and
  :class:`TieredKVStore` puts it behind an idle tier (the memory store): idle prefixes stay
  in free slots, and blocks are written when an idle prefix is evicted (``disk``) or as
  soon as a sequence finishes (``mooncake``: other servers can reuse it at once).

Stale KV never serves a new policy. The engine calls :meth:`KVStore.clear` at every weight
update (an idle tier drops everything), and block keys carry :attr:`SlotPool.namespace`
(the model's identity and the policy version), so after an update every old block misses
and ages out of its store. A sequence that was running across the update holds KV of two
policies: the memory store still keeps it (as vLLM's prefix cache does), but a store that
sets ``current_weights_only`` (both tiered stores) never receives it: such KV must not be
published under the new version's keys.

Who calls what, and when: only the engine's thread, between two forwards, calls a
:class:`KVStore` (never an HTTP handler), so implementations need no locks. Nothing here is
called per decoded token: lookups happen once per admitted sequence, ``keep`` once per
finished one.

This module imports nothing heavy at import time (torch only inside the functions that
move tensors): plugin modules and ``primerl plugins list`` may import it.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import warnings
from collections.abc import Callable, Collection, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs


class KVCache(Protocol):
    """What a KV store may do to the engine's KV cache (a :class:`primerl.models.batch.SlotCache`)."""

    def copy_prefix(self, src_slot: int, dst_slot: int, n: int) -> None:
        """Copy the first ``n`` cached positions of ``src_slot`` into ``dst_slot``."""

    def read(self, slot: int, start: int, n: int) -> dict[str, Any]:
        """Positions ``start .. start+n-1`` of ``slot``: per cache tensor (``"{layer}.{name}"``)
        a tensor ``[n, *shape]``, a view into the cache (copy it before the slot changes)."""

    def write(self, slot: int, start: int, tensors: dict[str, Any]) -> None:
        """Write what :meth:`read` returned (every tensor ``[n, *shape]``, any device) at
        positions ``start .. start+n-1`` of ``slot``."""


class HandoffUnavailable(Exception):
    """This KV store cannot hand KV to another server (:meth:`KVStore.handoff_blocks`): the
    message says why and what to run instead."""


IN_PROCESS = ("keeps KV inside its process, so it cannot hand a prompt's KV between prefill and decode servers: "
              "start every server with a KV store that shares it (--inference.kv_store disk, one shared directory, "
              "or mooncake)")


class SlotPool:
    """The engine's KV cache as a store sees it: ``num_slots`` slots and the set of free ones.

    A slot is in exactly one of three states: *free* (in :attr:`free`), *running* (holds a
    sequence the engine is generating; the engine owns it) or *held* by the store (an idle
    cached prefix; :meth:`KVStore.slots`). The engine takes a slot with :meth:`acquire`;
    whoever owns a slot gives it back with :meth:`release`.

    ``model`` names what computed the cache's KV (:func:`model_identity`: the architecture
    and a fingerprint of the weights it started from) and ``version`` is the engine's policy
    version (the engine sets it at every weight update, before it calls
    :meth:`KVStore.clear`); :attr:`namespace` joins them for :func:`block_keys`.
    """

    def __init__(self, cache: KVCache, num_slots: int, *, model: str = "model") -> None:
        self.cache = cache
        self.num_slots = num_slots
        self.free: set[int] = set(range(num_slots))
        self.model = model
        self.version = 0

    @property
    def namespace(self) -> str:
        """What KV depends on besides the tokens: ``"{model}@v{version}"``."""
        return f"{self.model}@v{self.version}"

    def acquire(self, slot: int) -> None:
        """Take ``slot`` out of the free set (it must be free: see :meth:`KVStore.vacate`)."""
        self.free.discard(slot)

    def release(self, slot: int) -> None:
        """Give ``slot`` back: its contents are garbage from now on."""
        self.free.add(slot)

    def copy(self, src: int, dst: int, n: int) -> None:
        """Copy the first ``n`` positions of slot ``src`` into slot ``dst``."""
        self.cache.copy_prefix(src, dst, n)

    def read(self, slot: int, start: int, n: int) -> dict[str, Any]:
        """Positions ``start .. start+n-1`` of ``slot`` (views: see :meth:`KVCache.read`)."""
        return self.cache.read(slot, start, n)

    def write(self, slot: int, start: int, tensors: dict[str, Any]) -> None:
        """Restore what :meth:`read` returned at positions ``start ..`` of ``slot``."""
        self.cache.write(slot, start, tensors)


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


@attrs.frozen(kw_only=True)
class KVStoreCapabilities:
    """What a KV store declares when it registers (``register(..., capabilities=...)``).

    ``shares_across_processes``: what one server stores, another server of the run can load
    (a shared directory, a pool): prefill/decode disaggregation hands KV over through it.
    ``run_service``: ``"module:attr"`` of what a run needs set up once, before its servers
    (Mooncake's master; the disk store's shared folder under prefill/decode): called
    ``(cfg, run_dir)`` by the launcher, it returns a started :class:`RunService`, or None
    when the run needs none (``inference.kv_store_options`` names a master already).
    """

    shares_across_processes: bool = False
    run_service: str | None = None


class RunService(Protocol):
    """What a launcher starts for a run's KV store and stops after it."""

    def options(self) -> dict[str, Any]:
        """Keyword arguments every server's store gets on top of ``inference.kv_store_options``
        (the launcher puts them in the run-time record, :mod:`primerl.runtime`)."""

    def describe(self) -> str | None:
        """One line for the launcher's output (None: nothing to say)."""

    def stop(self) -> None: ...


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

    ``current_weights_only``: when True, the engine never hands :meth:`keep` a sequence whose
    KV began under older weights (one that ran across a weight update); it releases that
    slot instead. Stores that publish blocks under the current version's keys set it.

    What a store offers beyond this class's members it declares when it registers
    (:class:`KVStoreCapabilities`).
    """

    current_weights_only: bool

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

    def handoff_blocks(self) -> BlockSlotStore:
        """The block tier that other servers of the run read what this store writes:
        prefill/decode hands a prompt's KV from a prefill to a decode server through it.
        Raises :class:`HandoffUnavailable` (why, and the fix) when the store keeps KV where
        no other server reads it."""


def model_identity(model: Any) -> str:
    """A name for the weights a model starts from, the same in every server of a run:
    the class and a hash of its parameter count, first parameter's dtype and first values.

    Two processes that build the same preset with the same seed, or load the same
    checkpoint, get the same name (their blocks are shared); a different seed, checkpoint,
    architecture or dtype gets another. Later weights are told apart by the version
    (:attr:`SlotPool.version`), so this is computed once, at engine start.
    """
    params = list(model.parameters()) if hasattr(model, "parameters") else []
    h = hashlib.blake2b(type(model).__qualname__.encode(), digest_size=8)
    h.update(str(sum(p.numel() for p in params)).encode())
    if params:
        first = params[0].detach().reshape(-1)[:256].float().cpu()
        h.update(str(params[0].dtype).encode())
        h.update(first.numpy().tobytes())
    return f"{type(model).__name__}-{h.hexdigest()}"


# ---- the block level: fixed-size KV blocks keyed by their prefix --------------------------


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


@attrs.frozen
class KVBlock:
    """One block of a block store: the KV of ``block_size`` consecutive tokens after a prefix.

    ``key``: :func:`block_keys` of the prefix ending with this block.
    ``tokens``: the block's token ids (a reader checks them: a hash collision is a miss).
    ``kv``: per cache tensor (``"{layer}.{name}"``: :meth:`KVCache.read`'s names, e.g. MLA's
    ``"0.ckv"``, GQA's ``"0.k"``/``"0.v"``), a tensor ``[block_size, *shape]`` on the CPU.
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
    """A store of KV blocks by key: files (``disk``), Mooncake Store's shared pool (``mooncake``).

    :class:`BlockSlotStore` adapts one to the engine. Blocks are immutable once put (their
    key is their content's hash), so stores may replicate and evict them freely; eviction
    policy is the store's. Called from the engine's thread only.
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
        full; a later :meth:`get` then misses. The blocks' tensors may be views into the
        engine's cache: copy (or serialize) what is kept before returning."""


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


@runtime_checkable
class ReportsEvictions(Protocol):
    """An idle tier that tells who set ``on_evict`` about each prefix it evicts to make room,
    ``on_evict(slot, tokens, routed)``, before it lets go of the slot (the disk store's
    ``SpillingMemoryStore``); a write-back :class:`TieredKVStore` needs one."""

    on_evict: Callable[[int, Sequence[int], list[Any]], None] | None


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


def env_int(name: str, default: int) -> int:
    """An integer setting from the environment variable ``name`` (a store's fallback when its
    constructor keyword is not given), else ``default``; a non-integer is a clear error."""
    import os

    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None
