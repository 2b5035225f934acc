"""What the trainer writes for the others and for itself: published weights, checkpoints.

* :func:`publish_weights`: policy v(n) for inference, ``weights/step_n/`` then ``STABLE``
  (through the filesystem or the shm channel, ``trainer.weight_channel``);
* :func:`prune_weights`: published versions no in-flight rollout can still need;
* :func:`save_checkpoint` / :func:`load_resume_state`: the resumable state
  (``checkpoints/step_n/``: HF weights + the trainer state file).

Every path comes from :class:`primerl.rundir.RunDir`, and every directory is written
under a temporary name and renamed (:func:`primerl.rundir.write_dir_atomically`), so the
orchestrator never loads half a version and a crash never leaves half a checkpoint.

The parallelism's layout is consulted here: the shm channel writes the tensors the
strategy's ``full_weights`` yields unit by unit (what a sharded strategy gathers), and
:func:`check_layout` refuses at start a layout whose weights are sharded, since HF
checkpoints and resumable checkpoints are written from a full model only.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch

from primerl.errors import PrimerlError
from primerl.parallel import Parallelism, ParallelLayout
from primerl.rundir import SHM_LINK, STABLE, TRAINER_STATE, RunDir, parse_step, write_dir_atomically


def check_layout(layout: ParallelLayout) -> None:
    """Fail at start, not at the first publish, on a layout these writers cannot handle."""
    if layout.shards_weights:
        raise PrimerlError(
            f"trainer.parallelism '{layout.strategy}' shards weights ({layout.describe()}), but the trainer "
            f"writes HF weights and checkpoints from a full model only: gathered checkpoint writing is not "
            f"implemented yet"
        )


def publish_weights(run: RunDir, n: int, model: torch.nn.Module, *, adapter: Any, tokenizer: Any,
                    parallelism: Parallelism, channel: str = "filesystem") -> Path:
    """``weights/step_n/``, then its empty ``STABLE`` file.

    ``filesystem``: an HF checkpoint + tokenizer (any server that sees the run directory
    loads it). ``shm``: one safetensors file of the model's own tensors in /dev/shm, linked
    from ``step_n/shm.safetensors``; a server on this machine adopts it without a copy.
    """
    final = run.weights_step(n)
    if channel == "shm":
        from primerl.weights import write_safetensors

        tensors: dict[str, torch.Tensor] = {}
        for _unit, part in parallelism.full_weights(model):
            tensors.update(part)
        target = run.shm_weights(n)
        target.parent.mkdir(parents=True, exist_ok=True)
        write_safetensors(tensors, target)

        def link(d: Path) -> None:
            d.mkdir(parents=True, exist_ok=True)
            (d / SHM_LINK).symlink_to(target)

        write_dir_atomically(final, link)
    else:
        write_dir_atomically(final, lambda d: adapter.save_checkpoint(model, d, tokenizer))
    (final / STABLE).touch()
    return final


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
                    scheduler: Any, *, adapter: Any, tokenizer: Any) -> Path:
    """``checkpoints/step_n/``: HF weights + the trainer state (optimizer, scheduler, step, RNG)."""

    def write(d: Path) -> None:
        adapter.save_checkpoint(model, d, tokenizer)
        state = {
            "step": n,
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
        }
        torch.save(state, d / TRAINER_STATE)  # last: its presence marks the checkpoint complete

    final = run.checkpoint(n)
    write_dir_atomically(final, write)
    return final


def load_resume_state(ckpt: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                      *, adapter: Any) -> int:
    """Restore weights, optimizer, scheduler and RNG from a checkpoint; returns its step."""
    adapter.load_checkpoint(model, ckpt)
    state = torch.load(ckpt / TRAINER_STATE, map_location="cpu", weights_only=False)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"])
    random.setstate(state["python_rng"])
    return int(state["step"])
