"""``single``: the whole model in one process, on a 1-rank mesh; nothing is sharded.

What it does: nothing to the model, builds the optimizer over it, and reports a layout
with one publishing unit per ``parallel_plan().fsdp_units`` entry (each decoder layer,
the embeddings, the head: the model contract, :class:`primerl.models.contract.CausalLM`)
plus the root unit for the rest, so that publishing walks the weights in the same units
a sharded strategy would gather.

Why it is a plugin like the others: the trainer reaches every strategy through the same
``primerl.parallel.Parallelism`` contract, so FSDP2 or expert parallel slot in beside it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import attrs
import torch
from torch.distributed.device_mesh import DeviceMesh

from primerl.errors import PrimerlError
from primerl.models.contract import CausalLM
from primerl.parallel import ROOT_UNIT, ParallelConfig, Parallelized, ParallelLayout, unit_of


def publishing_units(model: CausalLM) -> tuple[str, ...]:
    """``parallel_plan().fsdp_units`` (layers, embeddings, head), then the root unit."""
    return (*model.parallel_plan().fsdp_units, ROOT_UNIT)


class Single:
    """One process, one mesh dimension ``dp_replicate`` of size 1: the model as it is."""

    name = "single"

    def __init__(self) -> None:
        self.units: tuple[str, ...] = (ROOT_UNIT,)  # set by parallelize

    def mesh_shape(self, world_size: int, settings: ParallelConfig) -> dict[str, int]:
        if world_size != 1 or not settings.is_trivial():
            raise PrimerlError(f"trainer.parallelism 'single' runs one process, but the trainer has {world_size} "
                               f"ranks and [trainer.parallel] {attrs.asdict(settings)}: use trainer.parallelism "
                               f"fsdp (or auto), or trainer.nproc 1 with the [trainer.parallel] defaults")
        return {"dp_replicate": 1}

    def parallelize(self, model: torch.nn.Module, mesh: DeviceMesh,
                    build_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer]) -> Parallelized:
        self.units = publishing_units(model)
        model.to(mesh.device_type)  # the CPU stays where it is; CUDA: the one GPU of this rank
        mesh_dims = dict(zip(mesh.mesh_dim_names, mesh.shape, strict=True))
        layout = ParallelLayout(strategy=self.name, mesh=mesh_dims, units=self.units)  # no shards
        return Parallelized(model, build_optimizer(model), layout)

    def local_rows(self, num_rows: int) -> list[int | None]:
        return list(range(num_rows))

    def local_tokens(self, rows: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
        return rows

    def clip_grad_norm_(self, model: torch.nn.Module, max_norm: float) -> float:
        params = [p for p in model.parameters() if p.grad is not None]
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm)) if params else 0.0

    def sum_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        return values

    def max_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        return values

    def full_weights(self, model: torch.nn.Module) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
        """The model's own tensors (views, no copies), grouped by unit in the layout's order."""
        parts: dict[str, dict[str, torch.Tensor]] = {unit: {} for unit in self.units}
        for name, tensor in model.state_dict().items():
            parts[unit_of(name, self.units)][name] = tensor
        yield from parts.items()

    def optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return {"optimizer": get_optimizer_state_dict(model, optimizer)}

    def load_optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                             state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(model, optimizer, state["optimizer"])
