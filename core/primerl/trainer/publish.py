"""What the trainer writes for the others and for itself: published weights, checkpoints.

* :func:`publish_weights`: policy v(n) for inference, ``weights/step_n/`` then ``STABLE``
  (through the filesystem or the shm channel, ``trainer.weight_channel``);
* :func:`prune_weights`: published versions no in-flight rollout can still need;
* :func:`save_checkpoint` / :func:`load_resume_weights` + :func:`load_resume_state`: the
  resumable state (``checkpoints/step_n/``: HF weights, the optimizer state as a
  ``torch.distributed.checkpoint`` in ``optimizer/``, then the trainer state file).

Every path comes from :class:`primerl.rundir.RunDir`, and every directory is written
under a temporary name and renamed (:func:`primerl.rundir.write_dir_atomically`), so the
orchestrator never loads half a version and a crash never leaves half a checkpoint.

With several ranks, weights leave a sharded model without a full copy anywhere: every
rank walks the strategy's ``full_weights`` (which all-gathers one unit at a time), and
global rank 0 streams each unit into the checkpoint's shard files as it arrives. The
optimizer state is saved by every rank, each its own shards, with
``torch.distributed.checkpoint`` (DCP), which reshards on load: a checkpoint resumes on
any number of ranks (one process included), because the HF weights are loaded into the
full model before it is sharded and DCP redistributes the optimizer state.
"""

from __future__ import annotations

import os
import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from primerl.errors import PrimerlError
from primerl.inference import WeightSender
from primerl.parallel import Parallelism, barrier, is_publisher
from primerl.rundir import SHM_LINK, STABLE, TMP_PREFIX, TRAINER_STATE, RunDir, parse_step, write_dir_atomically

OPTIMIZER_DIR = "optimizer"  # in checkpoints/step_n: the optimizer state, a torch.distributed.checkpoint


def publish_weights(run: RunDir, n: int, model: torch.nn.Module, *, adapter: Any, tokenizer: Any,
                    parallelism: Parallelism, channel: str = "filesystem", sender: WeightSender | None = None
                    ) -> Path:
    """``weights/step_n/``, then its empty ``STABLE`` file (global rank 0 writes; every
    rank takes part in gathering).

    ``filesystem``: an HF checkpoint + tokenizer (any server that sees the run directory
    loads it). ``shm``: one safetensors file of the model's tensors in /dev/shm, linked
    from ``step_n/shm.safetensors``; a server on this machine adopts it without a copy.
    ``nccl``: ``sender`` streams the tensors, in HF names, straight to the servers unit by
    unit; ``step_n/`` holds only the sender's marker. v0 always goes through the
    filesystem (the servers start from it).
    """
    final = run.weights_step(n)
    units = parallelism.full_weights(model)
    if not is_publisher():
        for _ in units:  # the gathers need this rank
            pass
        return final
    if channel == "nccl" and sender is not None:
        from primerl.models.checkpoint import to_hf

        skip = ("lm_head.weight",) if getattr(model.config, "tie_word_embeddings", False) else ()
        sender.send(to_hf(_pairs(units), adapter.hf_format(), skip=skip), version=n)
        write_dir_atomically(final, lambda d: sender.mark(d, n))
    elif channel == "shm":
        from primerl.weights import write_safetensors

        tensors: dict[str, torch.Tensor] = {}
        for _unit, part in units:
            tensors.update(part)
        target = run.shm_weights(n)
        target.parent.mkdir(parents=True, exist_ok=True)
        write_safetensors(tensors, target)

        def link(d: Path) -> None:
            d.mkdir(parents=True, exist_ok=True)
            (d / SHM_LINK).symlink_to(target)

        write_dir_atomically(final, link)
    else:
        write_dir_atomically(final, lambda d: adapter.save_checkpoint(model, d, tokenizer, state=_pairs(units)))
    (final / STABLE).touch()
    return final


def _pairs(units: Iterator[tuple[str, dict[str, torch.Tensor]]]) -> Iterator[tuple[str, torch.Tensor]]:
    for _unit, part in units:
        yield from part.items()


def prune_weights(run: RunDir, n: int, keep_steps: int) -> list[int]:
    """Delete ``weights/step_m`` for m < n - keep_steps (and its shm file). Returns the deleted steps."""
    deleted = []
    if not run.weights.is_dir():
        return deleted
    for d in run.weights.iterdir():
        m = parse_step(d.name)
        if m is not None and m < n - keep_steps:
            link = d / SHM_LINK
            if link.is_symlink():
                Path(os.readlink(link)).unlink(missing_ok=True)  # the tmpfs file behind it
            shutil.rmtree(d, ignore_errors=True)
            deleted.append(m)
    return sorted(deleted)


def release_shm(run: RunDir) -> None:
    """Delete the run's shm folder at the end (tmpfs is RAM; ``checkpoints/`` keeps the result)."""
    shutil.rmtree(run.shm(), ignore_errors=True)


def save_checkpoint(run: RunDir, n: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: Any, *, adapter: Any, tokenizer: Any, parallelism: Parallelism) -> Path:
    """``checkpoints/step_n/``: HF weights, the optimizer state (DCP, every rank its shards),
    then the trainer state (scheduler, step, RNG), whose presence marks it complete. Every
    rank calls it; the directory is written under a name all ranks agree on, then renamed."""
    import torch.distributed.checkpoint as dcp

    final = run.checkpoint(n)
    tmp = final.with_name(f"{TMP_PREFIX}{final.name}")
    if is_publisher():
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    units = parallelism.full_weights(model)
    if is_publisher():
        adapter.save_checkpoint(model, tmp, tokenizer, state=_pairs(units))
    else:
        for _ in units:
            pass
    dcp.save(parallelism.optimizer_state(model, optimizer), checkpoint_id=str(tmp / OPTIMIZER_DIR))
    barrier()
    if is_publisher():
        state = {
            "step": n,
            "scheduler": scheduler.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
        }
        torch.save(state, tmp / TRAINER_STATE)  # last: its presence marks the checkpoint complete
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    barrier()
    return final


def load_resume_weights(ckpt: Path, model: torch.nn.Module, *, adapter: Any) -> None:
    """The checkpoint's HF weights into the full model, on every rank, before it is sharded."""
    adapter.load_checkpoint(model, ckpt)


def load_resume_state(ckpt: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                      *, parallelism: Parallelism) -> int:
    """The optimizer state (resharded by DCP to this layout), scheduler and RNG, after the
    model is laid out; returns the checkpoint's step. A checkpoint without an optimizer
    state in this format is refused with what to do."""
    import torch.distributed.checkpoint as dcp

    if not (ckpt / OPTIMIZER_DIR).is_dir():
        raise PrimerlError(f"{ckpt} has no {OPTIMIZER_DIR}/ (the optimizer state): it was written by an older "
                           f"primerl; start a new run with --model.checkpoint {ckpt} to train from its weights")
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    state_dict = parallelism.optimizer_state(model, optimizer)
    # partial: parameters that never had a gradient (e.g. a frozen indexer) have no saved
    # state; they keep the empty one the optimizer starts with
    dcp.load(state_dict, checkpoint_id=str(ckpt / OPTIMIZER_DIR), planner=DefaultLoadPlanner(allow_partial_load=True))
    parallelism.load_optimizer_state(model, optimizer, state_dict)
    state = torch.load(ckpt / TRAINER_STATE, map_location="cpu", weights_only=False)
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"])
    random.setstate(state["python_rng"])
    return int(state["step"])
