"""How the trainer lays a model out over processes: the ``Parallelism`` extension point.

A parallelism strategy is a plugin component (hook ``register_parallelisms``, selected by
``trainer.parallelism``, default ``single``). The trainer calls it once, right after the
model adapter has built the model:

1. ``mesh_shape(world_size)``: the named mesh dimensions the strategy uses and their
   sizes; the trainer creates the process group and ``init_device_mesh`` from it
   (:func:`device_mesh`).
2. ``parallelize(model, mesh, build_optimizer)``: wraps or shards the model on the mesh,
   builds the optimizer over the parameters it will train, and returns both with a
   :class:`ParallelLayout`, which the trainer logs once and publishing consults.
3. ``full_weights(model)``: whenever the trainer publishes weights, the model's full
   (unsharded) tensors, one *unit* (a decoder layer, the embeddings...) at a time, so
   that no rank ever holds the whole unsharded model.

Why an optimizer *factory*, not an optimizer: FSDP2's ``fully_shard`` replaces every
parameter with a sharded ``DTensor`` one, so an optimizer built before would step on
tensors the model no longer uses (torchtitan builds it after parallelizing, too).

Today the trainer is one process and ``single`` (no sharding, plugin
``plugins/parallelisms/single``) is the only strategy. What the contract already says for
the next ones — FSDP2 over ``dp_shard``, expert parallel over ``ep``, context parallel
over ``cp``, on several ranks:

* the mesh dimensions are the strategy's to name (``mesh_shape``); the layout records
  what is split over each one (:class:`Shard`: parameters, experts, the packed rows'
  sequence dimension, or the rows themselves);
* publishing gathers weights unit by unit through ``full_weights``: every rank calls it
  (it runs collectives), only the publishing rank (global rank 0) gets tensors and
  writes them; the units are the model's ``parallel_plan()["fsdp_units"]`` when it has
  one, the natural granularity of an FSDP2 all-gather;
* the trainer writes HF checkpoints and resumable checkpoints from a full model only, so
  it refuses, at start, a layout whose parameters are sharded
  (:func:`primerl.trainer.publish.check_layout`) until gathered checkpoint writing
  exists.

This module stays light (torch is imported inside functions): plugin modules and the
docs import it for the types.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Literal, NamedTuple, Protocol, runtime_checkable

import attrs

from primerl.errors import PrimerlError

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch.distributed.device_mesh import DeviceMesh

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
        split = "; ".join(
            f"{s.what} of {', '.join(s.modules) if s.modules else 'the model'} over {s.mesh_dim}" for s in self.shards
        )
        return f"{self.strategy} on mesh ({mesh}): {split or 'nothing sharded'}, {len(self.units)} publishing units"


class Parallelized(NamedTuple):
    """What ``Parallelism.parallelize`` returns."""

    model: torch.nn.Module  # the model to train: the same module, wrapped or sharded in place
    optimizer: torch.optim.Optimizer  # built by ``build_optimizer`` over the parallelized model
    layout: ParallelLayout


@runtime_checkable
class Parallelism(Protocol):
    """A trainer parallelism strategy (the target a ``register_parallelisms`` plugin
    registers is a class; the trainer instantiates it with no arguments)."""

    def mesh_shape(self, world_size: int) -> dict[str, int]:
        """The named mesh dimensions this strategy uses and their sizes, in mesh order, for
        ``world_size`` ranks (their product must be ``world_size``). Raise
        :class:`primerl.errors.PrimerlError` for a world size it cannot use."""
        ...

    def parallelize(
        self,
        model: torch.nn.Module,
        mesh: DeviceMesh,
        build_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
    ) -> Parallelized:
        """Wrap or shard ``model`` (built on every rank, float32 master weights) on ``mesh``,
        then build the optimizer with ``build_optimizer(model)`` over what it returns.
        The returned model keeps the forward signature of ``primerl.models.DecoderLM`` and
        the parameter names of the unwrapped model (publishing maps them to HF names)."""
        ...

    def full_weights(self, model: torch.nn.Module) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
        """``(unit, {name: full tensor})`` for each unit of the layout, in its order, with
        the names of ``model.state_dict()``; together the units cover every tensor once.
        Every rank must iterate to the end (a sharded strategy all-gathers one unit per
        step); ranks other than global rank 0 may receive empty dicts. Tensors may be
        views of the model's own (valid until the next optimizer step)."""
        ...


@contextmanager
def device_mesh(shape: Mapping[str, int], device_type: str = "cpu") -> Iterator[DeviceMesh]:
    """A process group and a ``DeviceMesh`` of ``shape`` for the trainer's lifetime.

    The trainer runs as one process today: this makes a 1-rank gloo group on an in-memory
    store (no ports, no environment variables) and destroys it on exit. A group that
    already exists (a caller's, e.g. under torchrun) is used as it is and left alone.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    owned = not dist.is_initialized()
    if owned:
        if math.prod(shape.values()) != 1:
            raise PrimerlError(f"mesh {dict(shape)} needs {math.prod(shape.values())} ranks; the trainer "
                               f"runs as one process (multi-rank launching is not implemented yet)")
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
