"""How the trainer lays a model out over processes: the ``Parallelism`` extension point.

A parallelism strategy is a plugin component (hook ``register_parallelisms``, selected by
``trainer.parallelism``; ``auto`` picks ``single`` for one rank and ``fsdp`` for more).
The trainer runs as ``trainer.nproc`` processes per node (torchrun starts them when more
than one); :func:`init_trainer_group` joins them in one process group (gloo on CPU, NCCL
on GPUs). Then it calls the strategy, once, right after the model adapter has built the
model on every rank:

1. ``mesh_shape(world_size, settings)``: the named dimensions of the world mesh and their
   sizes, from ``[trainer.parallel]`` (:class:`ParallelConfig`); the
   trainer creates the ``DeviceMesh`` from it (:func:`device_mesh`).
2. ``parallelize(model, mesh, build_optimizer)``: wraps or shards the model on the mesh
   (a strategy may build further views of it, e.g. expert parallel's), builds the
   optimizer over the parameters it will train, and returns both with a
   :class:`ParallelLayout`, which the trainer logs once and publishing consults.
3. Every step: ``local_rows(num_rows)`` says which packed rows this rank trains (its data
   parallel share, padded with ``None`` so every rank runs as many forwards as the others:
   collectives inside the forward need every rank), ``local_tokens(rows)`` cuts the rows'
   tokens to this rank's context-parallel share, ``clip_grad_norm_`` clips with the norm
   over every shard, and ``sum_over_ranks`` adds up per-rank statistics (losses, counts).
4. ``full_weights(model)``: whenever the trainer publishes weights, the model's full
   (unsharded) tensors, one *unit* (a decoder layer, the embeddings...) at a time, so
   that no rank ever holds the whole unsharded model; only global rank 0 gets tensors and
   writes them (HF checkpoints, the shm channel).

Why an optimizer *factory*, not an optimizer: FSDP2's ``fully_shard`` replaces every
parameter with a sharded ``DTensor`` one, so an optimizer built before would step on
tensors the model no longer uses (torchtitan builds it after parallelizing, too).

The loss is normalised by the step's loss-token count over the whole batch, so each
rank's loss is its share of one process's loss and gradients are *summed* over ranks
(never averaged: that would divide by the number of ranks a second time).

This module stays light (torch is imported inside functions): plugin modules and the
docs import it for the types.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Protocol, runtime_checkable

import attrs

from primerl.errors import ConfigError, PrimerlError
from primerl.validators import positive

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ROOT_UNIT", "ParallelConfig", "ParallelLayout", "Parallelism", "ParallelismCapabilities", "Parallelized",
           "Shard", "ShardedThing", "barrier", "device_mesh", "init_trainer_group", "interface_towards", "is_publisher",
           "unit_of", "world_size"]


@attrs.define(kw_only=True)
class ParallelConfig:
    """The ``[trainer.parallel]`` section: the trainer's device mesh, as torchtitan lays it
    out. ``dp_replicate x dp_shard x cp`` is the number of ranks (nodes x nproc);
    expert parallel ``ep`` is carved out of ``dp_shard x cp`` (it must divide it)."""

    # replicas of the sharded model (HSDP's outer dimension): each trains its share of the
    # rows, gradients are summed over them
    dp_replicate: int = attrs.field(default=1, validator=positive)
    # FSDP2 shards: parameters, gradients and optimizer state split over this many ranks;
    # -1: the ranks the other dimensions leave
    dp_shard: int = attrs.field(default=-1)
    # context parallel: each row's tokens split over this many ranks (zigzag chunks), for rows
    # too long for one device
    cp: int = attrs.field(default=1, validator=positive)
    # expert parallel: the routed experts split over this many ranks, tokens sent to them
    # all-to-all; must divide dp_shard x cp
    ep: int = attrs.field(default=1, validator=positive)
    # FSDP2 keeps parameters, gradients and optimizer state in CPU memory: slower, for a
    # model that does not fit on the devices
    cpu_offload: bool = False

    def world_size(self) -> int | None:
        """Ranks the layout needs, or None when ``dp_shard`` fills whatever is given."""
        return None if self.dp_shard == -1 else self.dp_replicate * self.dp_shard * self.cp

    def is_trivial(self) -> bool:
        return self.dp_replicate == 1 and self.dp_shard in (-1, 1) and self.cp == 1 and self.ep == 1

    def resolved(self, world_size: int) -> ParallelConfig:
        """These settings for ``world_size`` ranks, ``dp_shard`` filled in; a ConfigError
        names the keys of a layout that does not fit."""
        rest = self.dp_replicate * self.cp
        dp_shard = world_size // rest if self.dp_shard == -1 else self.dp_shard
        if self.dp_shard == 0 or self.dp_shard < -1:
            raise ConfigError(f"trainer.parallel.dp_shard must be positive or -1 (the ranks the others leave), "
                              f"got {self.dp_shard}")
        if dp_shard < 1 or self.dp_replicate * dp_shard * self.cp != world_size:
            raise ConfigError(
                f"[trainer.parallel] dp_replicate ({self.dp_replicate}) x dp_shard ({self.dp_shard}) x cp ({self.cp}) "
                f"must equal the trainer's ranks, nodes x trainer.nproc = {world_size}: change trainer.nproc or "
                f"the [trainer.parallel] sizes")
        if (dp_shard * self.cp) % self.ep:
            raise ConfigError(f"trainer.parallel.ep ({self.ep}) must divide dp_shard x cp ({dp_shard} x {self.cp}): "
                              f"expert parallel is carved out of the FSDP ranks")
        return attrs.evolve(self, dp_shard=dp_shard)


# The module name of the root unit: every tensor not inside another unit (final norm...).
ROOT_UNIT = ""

ShardedThing = Literal["parameters", "experts", "sequence", "rows"]


@attrs.frozen
class Shard:
    """One thing a strategy splits over one mesh dimension.

    ``what``: ``parameters`` (each rank holds a slice of every tensor of ``modules``,
    FSDP2), ``experts`` (each rank holds whole experts of ``modules``, expert parallel),
    ``sequence`` (each rank runs a slice of every packed row's tokens, context parallel),
    ``rows`` (each rank gets its own packed rows, data parallel). ``modules`` are module
    names of the model; empty means the whole model (or, for ``sequence`` and ``rows``,
    none in particular).
    """

    what: ShardedThing
    mesh_dim: str
    modules: tuple[str, ...] = ()


@attrs.frozen
class ParallelLayout:
    """How a strategy laid the model out: logged once, consulted by publishing."""

    strategy: str  # the registered name, e.g. "single"
    mesh: dict[str, int]  # the mesh dimensions the strategy uses -> their sizes, in mesh order
    shards: tuple[Shard, ...] = ()  # empty: every rank holds the whole model and every row
    # Units of ``full_weights``, in the order it yields them: module names, each gathered
    # and published as one piece; ROOT_UNIT ("") holds every tensor outside the others.
    units: tuple[str, ...] = (ROOT_UNIT,)

    @property
    def world_size(self) -> int:
        return math.prod(self.mesh.values())

    @property
    def shards_weights(self) -> bool:
        """Whether some rank lacks some weight: publishing then has to gather."""
        return any(s.what in ("parameters", "experts") for s in self.shards)

    def describe(self) -> str:
        """One line for the log: ``single on mesh (dp_replicate=1): nothing sharded, 4 units``."""
        mesh = ", ".join(f"{d}={n}" for d, n in self.mesh.items())
        def what(s: Shard) -> str:
            if s.what in ("rows", "sequence"):
                return s.what
            return f"{s.what} of {', '.join(s.modules) if s.modules else 'the model'}"

        split = "; ".join(f"{what(s)} over {s.mesh_dim}" for s in self.shards)
        return f"{self.strategy} on mesh ({mesh}): {split or 'nothing sharded'}, {len(self.units)} publishing units"


class Parallelized(NamedTuple):
    """What ``Parallelism.parallelize`` returns."""

    model: torch.nn.Module  # the model to train: the same module, wrapped or sharded in place
    optimizer: torch.optim.Optimizer  # built by ``build_optimizer`` over the parallelized model
    layout: ParallelLayout


@attrs.frozen(kw_only=True)
class ParallelismCapabilities:
    """What a parallelism strategy declares when it registers (``register(..., capabilities=...)``).

    ``float32_on_cuda``: it computes in float32 on CUDA when ``trainer.precision`` says so
    (FSDP2 does not: it computes in bfloat16 there, masters and reductions in float32).
    ``max_ranks``: the most trainer ranks it lays out (0: any); a run whose trainer has more
    (``trainer.nproc`` x the launcher's trainer nodes) is refused when its config loads.
    """

    float32_on_cuda: bool = True
    max_ranks: int = 0


@runtime_checkable
class Parallelism(Protocol):
    """A trainer parallelism strategy (the target a ``register_parallelisms`` plugin
    registers is a class; the trainer instantiates it with no arguments)."""

    def mesh_shape(self, world_size: int, settings: ParallelConfig) -> dict[str, int]:
        """The named dimensions of the world mesh and their sizes, in mesh order, for
        ``world_size`` ranks and the ``[trainer.parallel]`` settings (their product must
        be ``world_size``). Raise :class:`primerl.errors.PrimerlError` naming the settings
        for a combination it cannot use."""
        ...

    def parallelize(
        self,
        model: torch.nn.Module,
        mesh: DeviceMesh,
        build_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
    ) -> Parallelized:
        """Wrap or shard ``model`` (built on every rank, on the CPU, float32 master weights) on
        ``mesh`` and place it on the mesh's device, then build the optimizer with
        ``build_optimizer(model)`` over what it returns.
        The returned model keeps the forward signature of ``primerl.models.DecoderLM`` and
        the parameter names of the unwrapped model (publishing maps them to HF names)."""
        ...

    def local_rows(self, num_rows: int) -> list[int | None]:
        """The packed rows (indices into the step's ``num_rows``, the same on every rank)
        this rank trains, padded with ``None`` to as many as any rank gets: a ``None`` is a
        forward over an empty row that only takes part in the collectives."""
        ...

    def local_tokens(self, rows: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
        """This rank's share of the tokens of a micro-batch of packed rows (every tensor is
        ``[k, m, ...]``); the identity unless the strategy splits sequences (context parallel)."""
        ...

    def clip_grad_norm_(self, model: torch.nn.Module, max_norm: float) -> float:
        """Clip the gradients in place to ``max_norm`` over every shard of every parameter;
        returns the norm before clipping (the same on every rank)."""
        ...

    def sum_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` (a float64 vector of per-rank statistics) summed over the ranks that
        split the batch (data and context parallel); the same result on every rank."""
        ...

    def max_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` (a float64 vector of per-rank maxima) maximised over the same ranks."""
        ...

    def full_weights(self, model: torch.nn.Module) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
        """``(unit, {name: full tensor})`` for each unit of the layout, in its order, with
        the names of ``model.state_dict()``; together the units cover every tensor once.
        Every rank must iterate to the end (a sharded strategy all-gathers one unit per
        step); ranks other than global rank 0 receive empty dicts. Tensors may be views of
        the model's own (valid until the next optimizer step)."""
        ...

    def optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer state as a ``torch.distributed.checkpoint`` state dict, keyed by
        parameter names, each rank's shards as DTensors (so DCP can reshard it to another
        layout on load); also the buffer ``dcp.load`` fills in place before
        ``load_optimizer_state``."""
        ...

    def load_optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                             state: dict[str, Any]) -> None:
        """Put ``state`` (``optimizer_state``'s dict, filled by ``dcp.load``) into the optimizer."""
        ...


def init_trainer_group(device: str) -> bool:
    """Join the trainer's ranks in one default process group when torchrun started them
    (``WORLD_SIZE`` > 1 in the environment): gloo on CPU, NCCL on CUDA. Returns whether it
    created the group (the caller then destroys it at exit); a group that already exists is
    left alone, and one process needs none (:func:`device_mesh` makes a 1-rank group).

    Across nodes gloo's ranks reach each other at the address of the interface on this
    node's route to ``MASTER_ADDR`` (``GLOO_SOCKET_IFNAME``, unless it is set): gloo's own
    choice, what the hostname resolves to, is 127.0.1.1 on a Debian node, which no other
    node reaches."""
    import os

    import torch
    import torch.distributed as dist

    if dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    elif "GLOO_SOCKET_IFNAME" not in os.environ and (name := interface_towards(os.environ.get("MASTER_ADDR", ""))):
        os.environ["GLOO_SOCKET_IFNAME"] = name  # torch's own knob, read when the group is made
    dist.init_process_group(backend)
    return True


def interface_towards(host: str) -> str | None:
    """The name of this machine's network interface on its route to ``host`` (no packet is
    sent), or None: ``host`` empty, unresolvable, or reached over loopback (one machine)."""
    import ipaddress
    import socket

    try:
        family, _, _, _, where = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(where)
            address = ipaddress.ip_address(s.getsockname()[0].split("%")[0])
    except (OSError, ValueError, IndexError):
        return None
    if address.is_loopback:
        return None
    return next((name for name, held in _interface_addresses() if held == address), None)


def _interface_addresses() -> list[tuple[str, Any]]:
    """(interface name, address) of every address this machine holds, IPv4 (ioctl
    SIOCGIFADDR) and IPv6 (``/proc/net/if_inet6``)."""
    import fcntl
    import ipaddress
    import socket
    import struct

    found: list[tuple[str, Any]] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:  # no IPv4 address
                continue
            found.append((name, ipaddress.ip_address(packed[20:24])))
    try:
        with open("/proc/net/if_inet6") as f:
            found += [(fields[5], ipaddress.ip_address(bytes.fromhex(fields[0])))
                      for fields in (line.split() for line in f) if len(fields) == 6]
    except OSError:
        pass
    return found


def barrier() -> None:
    """Wait for every trainer rank (nothing to wait for in one process)."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def is_publisher() -> bool:
    """Whether this rank writes what the trainer shares (weights, metrics, checkpoints,
    logs): global rank 0, or the only process."""
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


@contextmanager
def device_mesh(shape: Mapping[str, int], device_type: str = "cpu") -> Iterator[DeviceMesh]:
    """A ``DeviceMesh`` of ``shape`` over the trainer's process group, for its lifetime.

    Under torchrun the group exists (:func:`init_trainer_group`) and is used as it is. One
    process gets a 1-rank gloo group on an in-memory store (no ports, no environment
    variables), destroyed on exit.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    owned = not dist.is_initialized()
    ranks = dist.get_world_size() if not owned else 1
    if math.prod(shape.values()) != ranks:
        raise PrimerlError(f"the mesh {dict(shape)} needs {math.prod(shape.values())} ranks but the trainer has "
                           f"{ranks}: set trainer.nproc (per node) so that nodes x nproc matches [trainer.parallel]")
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh(device_type, tuple(shape.values()), mesh_dim_names=tuple(shape))
    finally:
        if owned:
            dist.destroy_process_group()


def world_size() -> int:
    """Ranks of the trainer: the existing process group's size, else 1 (one process)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def unit_of(name: str, units: tuple[str, ...]) -> str:
    """The unit a tensor name belongs to: the longest unit that is a module prefix of it,
    else ROOT_UNIT (``model.layers.1.mlp.w`` is in ``model.layers.1``, not ``model.layers.10``)."""
    best = ROOT_UNIT
    for unit in units:
        if unit and (name == unit or name.startswith(unit + ".")) and len(unit) > len(best):
            best = unit
    return best
