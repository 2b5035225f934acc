"""The KV store contract: what a store offers the embedded engine, vLLM and a launcher.

What and why. RL traffic repeats prefixes all the time: the ``n`` samples of a group share
their prompt, a multi-turn episode resends every earlier turn at each new turn, an agent
env reruns the same long system prompt. Recomputing such a prefix costs a prefill;
keeping its KV costs memory. A KV store (``register_kv_stores``, selected by
``inference.kv_store``) decides which prefixes are kept, where, and for how long. This
module holds its contract only; the stores live in their plugins (``memory``, ``disk``,
``mooncake``) and the block machinery they share in :mod:`primerl.kv_blocks`.

A store meets three parties, and declares what it needs from each:

* **the embedded engine** calls :class:`KVStore` (one engine, one slot cache seen through a
  :class:`SlotPool`): at admission, how much of a prompt it holds; every finished sequence
  ("keep this if you want it"); when it needs a cache slot back; when the weights change
  (KV computed by the old policy must not serve the new one). Stores of fixed-size blocks
  implement :class:`BlockKVStore` and reach the engine through
  :class:`primerl.kv_blocks.BlockSlotStore`;
* **vLLM** (``--inference.backend vllm``) plays a store with one of its KV connectors: the
  store declares it (:attr:`KVStoreCapabilities.vllm_connector`, a function returning a
  :class:`VllmConnector`), or declares that vLLM's own prefix cache does its job
  (:attr:`KVStoreCapabilities.vllm_prefix_cache`);
* **a launcher** starts what the run needs once, before its servers (a pool's master, a
  folder every server shares): the store declares its run service
  (:attr:`KVStoreCapabilities.run_service`, a function of the run config and a
  :class:`ServiceSite` returning a :class:`RunService`); every launcher starts it the same
  way (:mod:`primerl.kv_service`) and hands the options it returns to every server's store
  through the run-time record (:func:`store_options`).

Who calls what, and when: only the engine's thread, between two forwards, calls a
:class:`KVStore` (never an HTTP handler), so implementations need no locks. Nothing here is
called per decoded token: lookups happen once per admitted sequence, ``keep`` once per
finished one. This module imports nothing heavy: plugin modules and ``primerl plugins
list`` may import it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import attrs

if TYPE_CHECKING:  # pragma: no cover
    from primerl.kv_blocks import BlockSlotStore
    from primerl.rundir import RunDir

__all__ = [
    "IN_PROCESS",
    "BlockKVStore",
    "HandoffUnavailable",
    "KVBlock",
    "KVCache",
    "KVStore",
    "KVStoreCapabilities",
    "PrefixHit",
    "ReportsEvictions",
    "RunService",
    "ServiceSite",
    "SlotPool",
    "VllmConnector",
    "store_options",
]


# ---- the engine's side --------------------------------------------------------------------


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

    ``model`` names what computed the cache's KV (the engine's name for its starting
    weights, the same in every server of a run) and ``version`` is the engine's policy
    version (the engine sets it at every weight update, before it calls
    :meth:`KVStore.clear`); :attr:`namespace` joins them for block keys.
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


class KVStore(Protocol):
    """A per-engine KV store: finds, keeps and evicts cached prefixes for the embedded engine.

    The registered target (``register_kv_stores``) is a class or factory called with
    :func:`store_options` as keyword arguments; the engine then calls :meth:`bind` once and
    the other methods from its own thread. Routed experts travel with the KV: ``routed`` is
    a list of chunks, each ``[tokens, moe_layers, top_k]`` (a torch tensor; an empty list
    for dense models), in token order, covering exactly the stored tokens, so a sequence
    that reuses a prefix still reports every token's experts (router replay).

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


@runtime_checkable
class ReportsEvictions(Protocol):
    """An idle tier that tells who set ``on_evict`` about each prefix it evicts to make room,
    ``on_evict(slot, tokens, routed)``, before it lets go of the slot (the ``memory`` store
    does); a write-back :class:`primerl.kv_blocks.TieredKVStore` needs one."""

    on_evict: Callable[[int, Sequence[int], list[Any]], None] | None


# ---- the block level: fixed-size KV blocks keyed by their prefix --------------------------


@attrs.frozen
class KVBlock:
    """One block of a block store: the KV of ``block_size`` consecutive tokens after a prefix.

    ``key``: :func:`primerl.kv_blocks.block_keys` of the prefix ending with this block.
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

    :class:`primerl.kv_blocks.BlockSlotStore` adapts one to the engine. Blocks are immutable
    once put (their key is their content's hash), so stores may replicate and evict them
    freely; eviction policy is the store's. Called from the engine's thread only.
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


# ---- what a store declares: its capabilities, its vLLM connector, its run service ----------


@attrs.frozen(kw_only=True)
class KVStoreCapabilities:
    """What a KV store declares when it registers (``register(..., capabilities=...)``); read
    from the registry without importing the store.

    ``shares_across_processes``: what one server stores, another server of the run can load
    (a shared directory, a pool): prefill/decode disaggregation hands KV over through it.

    ``run_service``: ``"module:attr"`` of ``(cfg, site: ServiceSite) -> RunService | None``,
    what the run needs set up once before its servers (Mooncake's master; the disk store's
    shared folder under prefill/decode). Every launcher calls it the same way
    (:mod:`primerl.kv_service`): the local launcher in its own process, a Slurm job as a step
    of its own on its first node. It returns a started service, or None when this run needs
    none (``inference.kv_store_options`` names a master already).

    ``vllm_connector``: ``"module:attr"`` of ``(options: dict, directory: Path) ->
    VllmConnector``, the vLLM KV connector that plays this store under ``--inference.backend
    vllm``. ``options`` are the store's (:func:`store_options`: ``inference.kv_store_options``
    and what its run service set), ``directory`` a folder of the run for the connector's
    files. It is called when the config is checked (with the config's options alone) and
    when each server starts: keep it pure (no I/O; files are returned, the backend writes
    them) and its module light.

    ``vllm_prefix_cache``: vLLM's own prefix cache does this store's job (idle prefixes in
    free KV blocks, least recently used evicted): the store needs no connector under vLLM.
    A store that declares neither is refused with ``--inference.backend vllm``.
    """

    shares_across_processes: bool = False
    run_service: str | None = None
    vllm_connector: str | None = None
    vllm_prefix_cache: bool = False


@attrs.frozen(kw_only=True)
class VllmConnector:
    """What a KV store needs from vLLM: the KV connector that plays its part there.

    ``transfer_config``: vLLM's ``--kv-transfer-config`` (its ``KVTransferConfig`` as a JSON
    object): ``kv_connector`` (the connector's class name), ``kv_role`` (``kv_both`` for a
    store every server reads and writes), and whatever else the connector takes
    (``kv_connector_extra_config``, ``kv_connector_module_path`` for one outside vLLM).
    ``env``: environment variables the connector reads in vLLM's processes.
    ``files``: files the connector reads, written before vLLM starts (path -> text; paths
    under the ``directory`` the connector function was given).
    ``devices``: the vLLM builds it runs on (``("cuda",)``: its GPU build only); empty: any.
    """

    transfer_config: Mapping[str, Any]
    env: Mapping[str, str] = attrs.field(factory=dict)
    files: Mapping[str, str] = attrs.field(factory=dict)
    devices: tuple[str, ...] = ()

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.transfer_config.get("kv_connector"), str) or not self.transfer_config["kv_connector"]:
            raise ValueError("a VllmConnector's transfer_config needs 'kv_connector', the connector's class name")

    @property
    def name(self) -> str:
        """The connector's class name (``kv_connector``)."""
        return self.transfer_config["kv_connector"]


@attrs.frozen(kw_only=True)
class ServiceSite:
    """Where a launcher starts a KV store's run service (what the service may depend on).

    ``run_dir``: the run's directory (:class:`primerl.rundir.RunDir`: ``logs/`` for the
    service's log). ``host``: the address the service listens on, one every server of the
    run reaches (``inference.host`` on one machine; the job's first node under Slurm).
    ``port``: the first of the ports it may take, one after another (a Slurm job on several
    nodes fixes them: ``launcher.kv_service_port``); 0: free ones. ``launch``: what tells this
    launch of the run from another (the Slurm job id; empty locally), for what must not
    outlive the launch (a folder named with it).
    """

    run_dir: RunDir
    host: str = "127.0.0.1"
    port: int = 0
    launch: str = ""


class RunService(Protocol):
    """What a launcher starts for a run's KV store (:attr:`KVStoreCapabilities.run_service`)
    and stops after the run's servers."""

    def options(self) -> dict[str, Any]:
        """Keyword arguments every server's store gets on top of ``inference.kv_store_options``
        (the launcher puts them in the run-time record, :mod:`primerl.runtime`); JSON values."""

    def describe(self) -> str | None:
        """One line for the launcher's output (None: nothing to say)."""

    def alive(self) -> bool | None:
        """Whether the service still serves: True while its process runs, False once it has
        ended (the run cannot go on); None for a service that runs nothing (a folder)."""

    def stop(self) -> None: ...


def store_options(cfg: Any) -> dict[str, Any]:
    """The keyword arguments of this run's KV store: ``inference.kv_store_options`` and, on
    top, what the launcher's run service set (the run-time record), as every server's store
    (and vLLM's connector) gets them."""
    from primerl.runtime import read_runtime

    started = read_runtime(cfg.output_dir)
    return {**cfg.inference.kv_store_options, **(started.kv_store_options if started else {})}
