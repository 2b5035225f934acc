"""One RL step on a layout, for checking a layout against one process (tests and
``bench/parallel_parity.py``).

:func:`step_on_layout` runs, on each rank of an initialized group (see
:func:`primerl_fsdp.ranks.run_on_ranks`), the trainer's own code path: the model plugin's
tiny preset built with a fixed seed, the strategy ``trainer.parallelism`` resolves to,
``rl_step`` over a fixed batch of packed samples (several segments per row, padding,
uneven rows per rank, optional router replay), and returns the step's loss and every
parameter's *full* gradient on rank 0: FSDP's DTensor gradients all-gathered, expert
shards gathered over their ep group. :func:`max_rel_err` compares two such results.

The optimizer is SGD with lr 0 and gradient clipping off (a huge max norm), so the
gradients compared are the raw ones of the loss.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def samples(vocab: int, n: int = 12, seed: int = 1, *, replay: tuple[int, int, int] | None = None) -> list[Any]:
    """``n`` samples of 9 to 9 + 5(n-1) tokens, prompt unmasked, one advantage each; with
    ``replay`` = (moe_layers, top_k, experts), random routed experts to replay."""
    from primerl.samples import Sample

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = 9 + 5 * i
        tokens = torch.randint(1, vocab, (length,), generator=g).tolist()
        routed = None
        if replay is not None:
            layers, k, experts = replay
            routed = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(length * layers)]).view(
                length, layers, k).to(torch.int16)
        out.append(Sample(tokens=tokens, loss_mask=[0] * 3 + [1] * (length - 3),
                          logprobs=(-torch.rand(length, generator=g) * 3).tolist(),
                          advantage=(i - n / 2) / n, task_id=str(i), routed_experts=routed))
    return out


def step_on_layout(model_name: str, parallel: dict[str, int], replay: bool = False, *, seq_len: int = 96,
                   micro_batch_rows: int = 2) -> dict[str, Any]:
    """Rank 0: ``{"loss", "grad_norm", "grads": {name: full gradient}}`` of one ``rl_step``
    of ``model_name``'s tiny preset on this group with ``[trainer.parallel]`` = ``parallel``;
    other ranks: the same without ``grads``."""
    import attrs

    from primerl.algorithms import build_loss
    from primerl.config import RunConfig
    from primerl.models import ModelConfig
    from primerl.parallel import ParallelConfig, device_mesh, world_size
    from primerl.registry import get_registry
    from primerl.trainer.packing import pack
    from primerl.trainer.step import rl_step

    cfg = RunConfig()
    cfg.trainer = attrs.evolve(cfg.trainer, micro_batch_rows=micro_batch_rows, seq_len=seq_len, router_replay=replay,
                               max_grad_norm=1e9, nproc=world_size(), parallel=ParallelConfig(**parallel))
    adapter = get_registry().load("model", model_name)()
    model = adapter.build(ModelConfig(name=model_name, preset="tiny", dtype="float32", seed=7)).train()
    layout_replay = None
    if replay:
        moe = model.parallel_plan().experts
        if moe:
            n_experts = model.get_submodule(moe[0]).down_proj.shape[0]
            layout_replay = (len(moe), model.config.num_experts_per_tok, n_experts)
    batch = samples(model.vocab_size, replay=layout_replay)
    strategy = get_registry().load("parallelism", cfg.trainer.resolved_parallelism())()
    settings = cfg.trainer.parallel.resolved(world_size())
    with device_mesh(strategy.mesh_shape(world_size(), settings)) as mesh:
        model, optimizer, _ = strategy.parallelize(model, mesh, lambda m: torch.optim.SGD(m.parameters(), lr=0.0))
        stats = rl_step(model, optimizer, pack(batch, seq_len), build_loss("default"), cfg, strategy,
                        join=adapter.capabilities(ModelConfig(name=model_name)).varlen_rows)  # as the trainer runs
        grads = full_gradients(model, strategy)
    out = {"loss": stats["loss"], "grad_norm": stats["grad_norm"]}
    if not dist.is_initialized() or dist.get_rank() == 0:
        out["grads"] = grads
    return out


def full_gradients(model: torch.nn.Module, strategy: Any) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient (zeros where it has none), on every rank that
    gathers it: DTensors all-gathered, expert shards all-gathered over the ep group."""
    from torch.distributed.tensor import DTensor

    expert_names: set[str] = set()
    try:
        from primerl_fsdp.expert_parallel import expert_parameters

        expert_names = {n for n, _ in expert_parameters(model)}
    except ImportError:  # pragma: no cover - the plugin ships both modules
        pass
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        if isinstance(g, DTensor):
            g = g.full_tensor()
        if name in expert_names:
            group = getattr(strategy, "ep_group", None)
            parts = [torch.empty_like(g) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, g.contiguous(), group=group)
            g = torch.cat(parts)
        out[name] = g.detach().clone()
    return out


def max_rel_err(reference: dict[str, Any], other: dict[str, Any]) -> float:
    """The largest relative error of the loss and of any parameter's gradient (Frobenius
    norm of the difference over the reference's, floored at 1e-12)."""
    errors = [abs(other["loss"] - reference["loss"]) / max(abs(reference["loss"]), 1e-12)]
    for name, g in reference["grads"].items():
        h = other["grads"][name]
        if h.shape != g.shape:
            raise AssertionError(f"{name}: gradient shape {tuple(h.shape)} against {tuple(g.shape)}")
        errors.append(float((h - g).norm() / max(float(g.norm()), 1e-12)))
    return max(errors)
