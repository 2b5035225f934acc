"""What the trainer writes for the others and for itself: published weights, checkpoints.

* :func:`publish_weights`: policy v(n) for inference, ``weights/step_n/`` then ``STABLE``
  (through the filesystem or the shm channel, ``trainer.weight_channel``);
* :func:`prune_weights`: published versions no in-flight rollout can still need;
* :func:`save_checkpoint` / :func:`load_resume_weights` + :func:`load_resume_state`: the
  resumable state (``checkpoints/step_n/``: HF weights, the optimizer state as a
  ``torch.distributed.checkpoint`` in ``optimizer/``, the orchestrator's data position of
  batch n, then the trainer state file and a manifest of every file's size, which
  ``primerl.resume.check_checkpoint`` verifies before a resume);
* :func:`prune_checkpoints`: all but the newest ``trainer.keep_checkpoints``, once a new
  one is complete.

A checkpoint that cannot be written (a full disk, a read-only directory) stops the trainer
with one line naming the cause and the last complete checkpoint, which stays as it was:
the half-written directory is removed and nothing older is pruned before a new one is done.

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

import errno
import json
import os
import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from primerl.errors import PrimerlError
from primerl.inference import WeightSender
from primerl.lora import ADAPTER_DIR, Split, lora_modules, merged, write_peft_adapter
from primerl.parallel import Parallelism, is_publisher
from primerl.rundir import (
    MANIFEST,
    OPTIMIZER_DIR,
    ORCHESTRATOR_STATE,
    SHM_LINK,
    STABLE,
    TMP_PREFIX,
    TRAINER_STATE,
    RunDir,
    parse_step,
    step_name,
    write_dir_atomically,
)

__all__ = ["OPTIMIZER_DIR", "load_resume_state", "load_resume_weights", "prune_checkpoints", "prune_weights",
           "publish_weights", "release_shm", "save_checkpoint"]


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
    if adapters := lora_modules(model):  # inference serves the merged weights
        units = merged(units, next(iter(adapters.values())).scale)
    if not is_publisher():
        for _ in units:  # the gathers need this rank
            pass
        return final
    if channel == "nccl" and sender is not None:
        from primerl.models.checkpoint import to_hf

        plan = model.parallel_plan()  # the model contract: whether the head is the embeddings' weight
        skip = (f"{plan.head}.weight",) if plan.tied_embeddings else ()
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
    the orchestrator's record of batch n (``rollouts/step_n.state.json``), the trainer state
    (scheduler, step, RNG) and the manifest. Every rank calls it; the directory is written
    under a name all ranks agree on, then renamed: it exists complete or not at all.

    A write that fails on any rank (no space left, no permission) removes the half-written
    directory and raises :class:`PrimerlError` on every rank, naming the cause and the last
    complete checkpoint, which is untouched."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    final = run.checkpoint(n)
    tmp = final.with_name(f"{TMP_PREFIX}{final.name}")
    failure: BaseException | None = None
    if is_publisher():
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        except OSError as exc:
            failure = exc
    if _any_rank(failure is not None):  # every rank stops together, before any collective
        raise _unwritable(run, n, failure, tmp)
    units = parallelism.full_weights(model)
    wrapped = lora_modules(model)
    if is_publisher():
        try:
            if wrapped:  # the frozen weights as an HF checkpoint, the adapters beside them in PEFT's format
                split = Split(units)
                adapter.save_checkpoint(model, tmp, tokenizer, state=split.base())
                one = next(iter(wrapped.values()))
                write_peft_adapter(tmp / ADAPTER_DIR, split.adapters, rank=one.rank, alpha=one.scale * one.rank,
                                   base_model=None)
            else:
                adapter.save_checkpoint(model, tmp, tokenizer, state=_pairs(units))
        except Exception as exc:  # noqa: BLE001 - safetensors reports a full disk as its own error
            failure = exc
    for _ in units:  # the other ranks' gathers need this one to the end, even after a failed write
        pass
    try:
        dcp.save(parallelism.optimizer_state(model, optimizer), checkpoint_id=str(tmp / OPTIMIZER_DIR))
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP wraps the writers' OSError (a BaseException)
        failure = failure or exc
    if _any_rank(failure is not None):  # also: every rank's optimizer shards are written
        raise _unwritable(run, n, failure, tmp)
    if is_publisher():
        try:
            state = {
                "step": n,
                "policy_version": n,
                "scheduler": scheduler.state_dict(),
                "torch_rng": torch.get_rng_state(),
                "python_rng": random.getstate(),
            }
            if run.batch_state(n).is_file():  # the orchestrator's data position of batch n
                shutil.copyfile(run.batch_state(n), tmp / ORCHESTRATOR_STATE)
            torch.save(state, tmp / TRAINER_STATE)
            from primerl.resume import manifest

            (tmp / MANIFEST).write_text(json.dumps(manifest(tmp), indent=1))
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
        except Exception as exc:  # noqa: BLE001 - torch.save reports a full disk as a RuntimeError
            failure = exc
    if _any_rank(failure is not None):
        raise _unwritable(run, n, failure, tmp)
    return final


def _any_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on any trainer rank (every rank calls it)."""
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return flag
    t = torch.tensor([int(flag)], device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _unwritable(run: RunDir, n: int, exc: BaseException | None, tmp: Path) -> PrimerlError:
    """The one-line error of a checkpoint that could not be written; its half is removed."""
    if is_publisher():
        shutil.rmtree(tmp, ignore_errors=True)
    cause = _cause(exc, run.checkpoints) if exc is not None else \
        "another trainer rank failed to write its part (see its log)"
    done = [m for m in run.checkpoint_steps() if m != n]
    last = (f"the last complete checkpoint, checkpoints/{step_name(done[-1])}, is intact and the same command "
            f"resumes from it" if done else "there is no earlier checkpoint: the same command starts over")
    return PrimerlError(f"could not write checkpoints/{step_name(n)}: {cause}; {last}")


def unwrap(exc: BaseException) -> BaseException:
    """The exception inside DCP's ``CheckpointException`` (its first failing rank's), else ``exc``."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(exc, CheckpointException) and exc.failures:
        inner = next(iter(exc.failures.values()))
        inner = inner[0] if isinstance(inner, tuple) else inner
        if isinstance(inner, BaseException):
            return inner
    return exc


def describe(exc: BaseException) -> str:
    """An exception in one line (DCP's: the failure inside it)."""
    exc = unwrap(exc)
    return f"{type(exc).__name__}: {exc}".splitlines()[0]


def _cause(exc: BaseException, where: Path) -> str:
    """An exception in one line: the OSError inside a wrapper (DCP's, safetensors', torch's)
    when there is one, and what to do about a full disk (``where``'s filesystem)."""
    inner: BaseException | None = exc
    while inner is not None and not isinstance(inner, OSError):
        nested = unwrap(inner)
        inner = nested if nested is not inner else (inner.__cause__ or inner.__context__)
    if isinstance(inner, OSError):
        text = f"{inner.strerror or inner}" + (f" ({inner.filename})" if inner.filename else "")
    else:
        text = describe(exc)
    try:
        nearly_full = shutil.disk_usage(where).free < 64 * 2**20
    except OSError:
        nearly_full = False
    full = (isinstance(inner, OSError) and inner.errno == errno.ENOSPC) or "No space left" in text \
        or "StorageFull" in text or nearly_full
    if full:
        text = (text if "No space left" in text else f"No space left on device ({text})") + \
            "; free space or lower trainer.keep_checkpoints"
    return text


def prune_checkpoints(run: RunDir, n: int, keep: int) -> list[int]:
    """Delete the complete checkpoints up to step n but the newest ``keep`` (0: keep all).
    Returns the deleted steps. Checkpoints after n are left alone."""
    if keep <= 0:
        return []
    steps = [m for m in run.checkpoint_steps() if m <= n]
    doomed = steps[:-keep]
    for m in doomed:
        shutil.rmtree(run.checkpoint(m), ignore_errors=True)
    return doomed


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
