"""``fsdp``: FSDP2 over ``dp_shard``, expert parallel over ``ep``, context parallel over ``cp``.

The trainer's ranks form the mesh torchtitan uses, ``dp_replicate x dp_shard x cp``
(``[trainer.parallel]``), in that order, so consecutive ranks share a context-parallel
group and then an FSDP group:

* **rows** (data parallel) are split over ``dp_replicate x dp_shard``: every rank packs the
  same batch and trains rows ``dp_rank, dp_rank + dp, ...``;
* **sequence** (context parallel): the ``cp`` ranks of a group train the same rows, each a
  share of their tokens (:mod:`.context_parallel`);
* **parameters** (FSDP2 ``fully_shard``): sharded over ``dp_shard x cp`` flattened (HSDP:
  replicated over ``dp_replicate``), one unit per decoder layer, the embeddings and the
  head (the model's ``parallel_plan().fsdp_units``), then the root;
* **experts** (expert parallel, :mod:`.expert_parallel`): carved out of ``dp_shard x cp``
  as torchtitan does: the world is also viewed as ``dp_replicate x efsdp x ep`` with
  ``efsdp = dp_shard x cp / ep``; ``ep`` consecutive ranks split each MoE layer's routed
  experts, and each experts module is its own FSDP unit over ``efsdp`` (HSDP over
  ``dp_replicate x efsdp``), so a rank holds ``E / ep`` experts' weights divided by
  ``efsdp``: what ``primerl plan`` counts.

Gradients are *summed* over ranks: the loss is normalised by the whole batch's loss
tokens, so each rank's gradient is its share of one process's. FSDP2 divides by the
number of ranks by default (and on gloo, where ``ReduceOp.AVG`` is missing, sums without
dividing: pytorch issue 162338); every FSDP module here is set to a divide factor of 1
with sum-only collectives, which is right on every backend.

What comes from where: plain ``torch.distributed`` (``fully_shard``, ``DeviceMesh`` views,
DTensor, DCP), not torchtitan's ``ParallelDims``/``apply_fsdp``: torchtitan 0.3.0 pins
``datasets<4.8`` (the verifiers env needs 5), expects its own decoder layout, and builds
its mesh for CUDA; the mesh layout and the ep-inside-fsdp carving follow it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from primerl.errors import PrimerlError
from primerl.models.contract import CausalLM
from primerl.parallel import ROOT_UNIT, ParallelConfig, Parallelized, ParallelLayout, Shard, unit_of


class FSDP:
    """FSDP2 with expert and context parallel (see the module docstring)."""

    name = "fsdp"

    def __init__(self) -> None:
        self.settings: ParallelConfig | None = None
        self.units: tuple[str, ...] = (ROOT_UNIT,)
        self.expert_modules: list[str] = []
        self.ep_group: Any = None
        self.sparse_mesh: DeviceMesh | None = None  # dp_replicate x efsdp x ep, with expert parallel
        self.cp_group: Any = None
        self.cp_rank = 0
        self.dp_rank, self.dp_size = 0, 1
        self.expert_mesh: DeviceMesh | None = None  # [edp, ep], made once for checkpoints
        self.expert_fsdp_placement: dict[str, tuple[Any, Any]] = {}  # expert parameter -> its FSDP mesh, placements

    # -- layout ------------------------------------------------------------------------

    def mesh_shape(self, world_size: int, settings: ParallelConfig) -> dict[str, int]:
        self.settings = s = settings.resolved(world_size)  # a ConfigError names the keys
        return {"dp_replicate": s.dp_replicate, "dp_shard": s.dp_shard, "cp": s.cp}

    def parallelize(self, model: CausalLM, mesh: DeviceMesh,
                    build_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer]) -> Parallelized:
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            FSDPModule,
            MixedPrecisionPolicy,
            OffloadPolicy,
            fully_shard,
        )

        s = self.settings
        if s is None:
            raise PrimerlError("FSDP.parallelize called before mesh_shape")
        replicate_rank = mesh["dp_replicate"].get_local_rank()
        shard_rank = mesh["dp_shard"].get_local_rank()
        self.cp_rank = mesh["cp"].get_local_rank()
        self.dp_rank, self.dp_size = replicate_rank * s.dp_shard + shard_rank, s.dp_replicate * s.dp_shard
        self.cp_group = mesh["cp"].get_group()
        fsdp_mesh = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        if s.dp_replicate > 1:
            fsdp_mesh = mesh["dp_replicate", "dp_shard_cp"]
        shards = [Shard("rows", "dp_replicate")] if s.dp_replicate > 1 else []
        shards += [Shard("rows", "dp_shard"), Shard("parameters", "dp_shard x cp")]

        plan = model.parallel_plan()
        device = model.device
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if device.type == "cuda" \
            else MixedPrecisionPolicy()
        if s.cpu_offload and device.type == "cpu":
            raise PrimerlError("trainer.parallel.cpu_offload keeps parameters, gradients and optimizer state in CPU "
                               "memory while a GPU computes (pinned memory needs an accelerator); this trainer runs "
                               "on the CPU already: leave cpu_offload off")
        offload = CPUOffloadPolicy() if s.cpu_offload else OffloadPolicy()
        if s.ep > 1:
            from primerl_fsdp.expert_parallel import shard_experts_

            world = dist.get_world_size()
            efsdp = s.dp_shard * s.cp // s.ep
            # rank r = (replicate * efsdp + e) * ep + k: ep consecutive ranks split the experts
            self.sparse_mesh = DeviceMesh(device.type, torch.arange(world).view(s.dp_replicate, efsdp, s.ep),
                                          mesh_dim_names=("dp_replicate", "efsdp", "ep"))
            self.ep_group = self.sparse_mesh["ep"].get_group()
            self.expert_modules = shard_experts_(model, self.ep_group)
            expert_fsdp_mesh = self.sparse_mesh["dp_replicate", "efsdp"] if s.dp_replicate > 1 \
                else self.sparse_mesh["efsdp"]
            for name in self.expert_modules:  # its own unit: the layer's unit below leaves it alone
                fully_shard(model.get_submodule(name), mesh=expert_fsdp_mesh, mp_policy=mp, offload_policy=offload)
            shards.append(Shard("experts", "ep", tuple(self.expert_modules)))
            shards.append(Shard("parameters", "efsdp", tuple(self.expert_modules)))
        if s.cp > 1:
            from primerl_fsdp.context_parallel import apply_context_parallel_

            apply_context_parallel_(model, self.cp_group)
            shards.append(Shard("sequence", "cp"))

        if device.type == "cuda":  # routers decide in float32 (near-tied experts flip in bf16): own units
            fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
            for name in plan.routers:
                fully_shard(model.get_submodule(name), mesh=fsdp_mesh, mp_policy=fp32, offload_policy=offload)
        head_units = (plan.head, plan.embeddings) if plan.tied_embeddings else ()  # a tied pair stays with the root
        self.units = (*plan.fsdp_units, ROOT_UNIT)
        for unit in plan.fsdp_units:
            if unit not in head_units:
                fully_shard(model.get_submodule(unit), mesh=fsdp_mesh, mp_policy=mp, offload_policy=offload)
        fully_shard(model, mesh=fsdp_mesh, mp_policy=mp, offload_policy=offload)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
        layout = ParallelLayout(strategy=self.name, mesh=dict(zip(mesh.mesh_dim_names, mesh.shape, strict=True)),
                                shards=tuple(shards), units=self.units)
        return Parallelized(model, build_optimizer(model), layout)

    # -- every step --------------------------------------------------------------------

    def local_rows(self, num_rows: int) -> list[int | None]:
        mine: list[int | None] = list(range(self.dp_rank, num_rows, self.dp_size))
        return mine + [None] * (math.ceil(num_rows / self.dp_size) - len(mine))

    def local_tokens(self, rows: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
        if self.settings is None or self.settings.cp == 1:
            return rows
        from primerl_fsdp.context_parallel import split_row_for_cp

        return split_row_for_cp(rows, self.cp_rank, self.settings.cp)

    def clip_grad_norm_(self, model: torch.nn.Module, max_norm: float) -> float:
        """The norm over every shard: the dense gradients' (DTensors on the FSDP mesh, whose
        norm DTensor reduces over it) and the experts' (DTensors on the efsdp mesh, reduced
        over it, then summed over the ep ranks, which hold different experts)."""
        from torch.distributed.tensor import DTensor

        from primerl_fsdp.expert_parallel import expert_parameters

        expert_ids = {id(p) for _, p in expert_parameters(model)}
        dense = [p.grad for p in model.parameters() if p.grad is not None and id(p) not in expert_ids]
        experts = [p.grad for p in model.parameters() if p.grad is not None and id(p) in expert_ids]

        def sq_norm(grads: list[torch.Tensor]) -> torch.Tensor:
            if not grads:
                return torch.zeros((), dtype=torch.float64)
            norm = torch.nn.utils.get_total_norm(grads)
            norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
            return norm.double().cpu() ** 2

        sq = sq_norm(dense)
        if self.ep_group is not None:
            expert_sq = sq_norm(experts).to(dense[0].device if dense else "cpu")
            dist.all_reduce(expert_sq, group=self.ep_group)
            sq = sq + expert_sq.cpu()
        total = float(sq.sqrt())
        coef = min(1.0, max_norm / (total + 1e-6))
        if coef < 1.0:
            for g in dense + experts:
                g.mul_(coef)
        return total

    def sum_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        """Every rank trains a disjoint part of the batch (rows, or tokens of rows): a sum
        over the whole world."""
        out = values.clone()
        dist.all_reduce(out)
        return out

    def max_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        out = values.clone()
        dist.all_reduce(out, op=dist.ReduceOp.MAX)
        return out

    # -- weights out -------------------------------------------------------------------

    def full_weights(self, model: torch.nn.Module) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
        """Unit by unit, in the layout's order: every DTensor all-gathered (all ranks), every
        expert-parallel module's experts gathered on rank 0 of its ep group (global rank 0
        is rank 0 of the first group); only global rank 0 keeps what it gets."""
        from torch.distributed.tensor import DTensor

        publisher = dist.get_rank() == 0
        state = model.state_dict()
        expert_owner = {f"{m}.{n}": m for m in self.expert_modules
                        for n in model.get_submodule(m).ep_sharded}
        by_unit: dict[str, list[str]] = {unit: [] for unit in self.units}
        for name in state:
            by_unit[unit_of(name, self.units)].append(name)
        for unit in self.units:
            part: dict[str, torch.Tensor] = {}
            gathered: set[str] = set()
            for name in by_unit[unit]:
                if name in expert_owner:
                    module_name = expert_owner[name]
                    if module_name not in gathered:
                        gathered.add(module_name)
                        from primerl_fsdp.expert_parallel import gather_experts

                        full = gather_experts(model.get_submodule(module_name), self.ep_group, dst=0)
                        if publisher:
                            part.update({f"{module_name}.{n}": t for n, t in full.items()})
                    continue
                t = state[name]
                t = t.full_tensor() if isinstance(t, DTensor) else t
                if publisher:
                    part[name] = t.detach().cpu()
            yield unit, part

    # -- checkpoints -------------------------------------------------------------------

    def optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The DCP state of the optimizer: FSDP's entries are DTensors already; an expert
        parameter's (a plain ``[E/ep, ...]`` slice) are wrapped as DTensors sharded on dim 0
        over the ep ranks, so DCP can reshard them to another ep size."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        state = get_optimizer_state_dict(model, optimizer)
        if self.ep_group is not None:
            self._wrap_expert_state(model, state)
        return {"optimizer": state}

    def load_optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                             state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
        from torch.distributed.tensor import DTensor, distribute_tensor

        opt = state["optimizer"]
        for name, entry in opt.get("state", {}).items():
            for key, value in list(entry.items()):
                if isinstance(value, DTensor) and getattr(value, "_primerl_expert", False):
                    full = value.to_local()  # this rank's E/ep experts, whole
                    mesh, placements = self.expert_fsdp_placement[name]
                    entry[key] = distribute_tensor(full, mesh, placements)  # back to its FSDP shard
        set_optimizer_state_dict(model, optimizer, opt)

    def _wrap_expert_state(self, model: torch.nn.Module, state: dict[str, Any]) -> None:
        """An expert parameter's state is a DTensor over the efsdp mesh of global shape
        [E/ep, ...]: the same name on every ep rank, for different experts. For DCP it is
        made whole over efsdp and re-wrapped as a DTensor of the whole [E, ...] over
        ``(edp, ep)``, sharded over ep, replicated over the rest."""
        from torch.distributed.tensor import DTensor, Replicate
        from torch.distributed.tensor import Shard as DShard

        from primerl_fsdp.expert_parallel import expert_parameters

        s = self.settings
        world = dist.get_world_size()
        if self.expert_mesh is None:  # [expert-data-parallel, ep]: rank r sits at (r // ep, r % ep)
            self.expert_mesh = DeviceMesh(model.device.type, torch.arange(world).view(world // s.ep, s.ep),
                                          mesh_dim_names=("edp", "ep"))
        per_param = state.get("state", {})
        for name, _param in expert_parameters(model):
            entry = per_param.get(name)
            if not entry:
                continue
            entry = per_param[name] = dict(entry)  # a copy: the optimizer's own dict stays as it is
            for key, value in list(entry.items()):
                if isinstance(value, DTensor) and value.dim() >= 1:
                    self.expert_fsdp_placement[name] = (value.device_mesh, value.placements)
                    whole = value.full_tensor()  # [E/ep, ...]
                    wrapped = DTensor.from_local(whole, self.expert_mesh, [Replicate(), DShard(0)], run_check=False)
                    wrapped._primerl_expert = True
                    entry[key] = wrapped
