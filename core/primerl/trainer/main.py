"""The trainer process: ``primerl trainer @ OUT/config.toml`` calls :func:`main`.

What it does, in order (files per docs/architecture.md, paths from ``RunDir``):

1. Join the other trainer ranks when torchrun started several (``trainer.nproc``); build
   the model (float32 master weights, whatever dtype inference serves in) from the model
   plugin, on ``trainer.device``; load the newest usable ``checkpoints/step_N`` into it
   if any (``primerl.resume.usable_checkpoint``, the same choice the orchestrator makes);
   lay it out with the parallelism plugin (``trainer.parallelism``) on a device mesh, which
   also builds AdamW; then the LR schedule and the optimizer state. A checkpoint that
   fails to load is set aside and the trainer stops: the same command then resumes from
   the one before (the orchestrator has already started from this one).
2. Otherwise: optional SFT warm-up on the env's reference answers (``[sft]``), then
   publish v0 as ``weights/step_000000`` so the orchestrator can start (:func:`begin`).
3. For n = start+1 .. max_steps (:func:`train`): wait for ``rollouts/step_n.pt``, read it
   (``primerl.samples.read_batch``), pack it, one optimizer step, publish
   ``weights/step_n`` + ``STABLE`` (:class:`Publisher`), prune old weights, hand the step's
   metrics (:func:`step_record`) to the monitors (``metrics.jsonl`` first, then W&B,
   TensorBoard... as ``[monitors]`` says; :mod:`primerl.monitors`), checkpoint every
   ``trainer.checkpoint_every`` steps and at the end (:func:`checkpoint`, keeping the newest
   ``trainer.keep_checkpoints``).

With several ranks every rank reads every batch and packs it the same way; the strategy
says which rows and tokens each trains; global rank 0 alone writes weights, metrics and
logs (checkpoints are written by all: each its optimizer shards).

Why this shape: the trainer never talks to the other processes except through files that
appear atomically (written under a temporary name, then renamed), so it runs unchanged
on one laptop or on a cluster with a shared filesystem. The pieces live beside this file:
:mod:`.step` (the RL step), :mod:`.sft`, :mod:`.publish` (weights, checkpoints, resume),
:mod:`.metrics`, :mod:`.optim`.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import attrs
import torch
from torch.distributed.checkpoint.api import CheckpointException

from primerl import watchdog
from primerl.algorithms import Correction, Loss, build_correction, build_loss
from primerl.config import RunConfig, to_dict
from primerl.errors import PluginError, PrimerlError
from primerl.monitors import MonitorSet, RunInfo, sample_rows
from primerl.parallel import Parallelism, barrier, device_mesh, init_trainer_group, is_publisher, world_size
from primerl.registry import get_registry
from primerl.resume import set_aside_checkpoint, trim_metrics, usable_checkpoint
from primerl.rundir import RunDir, step_name
from primerl.samples import RolloutBatch, read_batch
from primerl.trainer import log
from primerl.trainer.optim import make_optimizer, make_scheduler
from primerl.trainer.packing import PackedBatch, pack
from primerl.trainer.publish import (
    describe,
    load_resume_state,
    load_resume_weights,
    prune_checkpoints,
    prune_weights,
    publish_weights,
    release_shm,
    save_checkpoint,
)
from primerl.trainer.sft import sft_warmup
from primerl.trainer.step import rl_step

POLL_S = 0.05


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def build_model(cfg: RunConfig) -> tuple[Any, torch.nn.Module, Any]:
    """(adapter, float32 model in train mode, tokenizer) from the model plugin."""
    from primerl.registry import get_registry

    adapter = get_registry().load("model", cfg.model.name)()
    model_cfg = attrs.evolve(cfg.model, dtype="float32")  # master weights stay float32
    model = adapter.build(model_cfg)
    model.train()
    return adapter, model, adapter.tokenizer(cfg.model)


def load_parallelism(name: str) -> Parallelism:
    """The strategy ``trainer.parallelism`` names, instantiated."""
    from primerl.registry import get_registry

    strategy = get_registry().load("parallelism", name)()
    if not isinstance(strategy, Parallelism):
        raise PluginError(f"trainer.parallelism {name!r} is a {type(strategy).__name__}, which lacks the methods of "
                          f"primerl.parallel.Parallelism (mesh_shape, parallelize, full_weights)")
    return strategy


def weight_sender(cfg: RunConfig) -> Any:
    """The nccl channel's sender, from the inference backend (``primerl.inference.WeightSender``)."""
    from primerl.inference import inference_urls
    from primerl.registry import get_registry, load_target

    target = get_registry().capabilities("inference_backend", cfg.inference.backend).weight_sender
    log(f"weights go to inference over NCCL from now on ({cfg.inference.backend} backend)")
    return load_target(target)(cfg, inference_urls(cfg))


def wait_for(path: Path) -> None:
    """Poll until the orchestrator has renamed the batch into place."""
    while not path.exists():
        time.sleep(POLL_S)


def unloadable(run: RunDir, n: int, exc: BaseException) -> PrimerlError:
    """A checkpoint whose files passed the checks but do not load: set it aside (global rank
    0) and say so. The trainer stops rather than fall back by itself, because the
    orchestrator has already resumed its data position from this checkpoint; the same
    command starts both from the one before."""
    cause = describe(exc)
    where = "set aside"
    if is_publisher():
        try:
            where = f"moved to {set_aside_checkpoint(run, n)}"
        except OSError as move_error:
            where = f"could not be moved aside ({move_error.strerror}): delete it"
    return PrimerlError(f"checkpoints/{step_name(n)} does not load ({cause}); it was {where}; run the same "
                        f"command again to resume from the checkpoint before it")


def main(cfg: RunConfig) -> None:
    run = RunDir(cfg.output_dir)
    run.root.mkdir(parents=True, exist_ok=True)
    seed_everything(cfg.seed)
    t = cfg.trainer
    device = t.resolved_device()
    if device == "cuda" and not torch.cuda.is_available():
        raise PrimerlError("trainer.device is cuda but torch sees no CUDA GPU (a CPU build of torch, or no GPU "
                           "visible): set --trainer.device cpu or auto")
    if problem := t.precision_problem(device, cfg.trainer_world_size()):
        raise PrimerlError(problem)
    loss_fn = build_loss(t.loss, t.loss_options)  # fail fast on a bad name or option
    correction = build_correction(t.correction, t.correction_options)
    parallelism = load_parallelism(t.resolved_parallelism(cfg.trainer_world_size()))
    owns_group = init_trainer_group(device)
    watchdog.start(f"trainer-{torch.distributed.get_rank() if torch.distributed.is_initialized() else 0}", run, cfg)
    # the publishing rank's
    monitors = MonitorSet.for_run(cfg, log=log, registry=get_registry()) if is_publisher() else MonitorSet()
    watchdog.doing("loading the model", busy=True)
    try:
        adapter, model, tokenizer = build_model(cfg)
        n_params = sum(p.numel() for p in model.parameters())
        log(f"model {cfg.model.name} ({cfg.model.preset if cfg.model.checkpoint is None else cfg.model.checkpoint}), "
            f"{n_params / 1e6:.2f}M parameters, float32 master weights on {device}, "
            f"{t.resolved_precision()} compute")
        if t.fp8:
            from primerl.models.fp8_matmul import apply_fp8_matmuls_

            log(f"fp8: block-scaled FP8 matmuls in {len(apply_fp8_matmuls_(model))} modules")
        resume = usable_checkpoint(run, log=log)
        if resume is not None:  # into the full model, before it is sharded: any layout resumes any other
            try:
                load_resume_weights(resume[1], model, adapter=adapter)
            except Exception as exc:  # whatever a damaged file raises
                raise unloadable(run, resume[0], exc) from exc
        if t.lora.rank:  # the frozen weights are in place (checkpoint or resume): wrap their linears
            from primerl import lora

            experts = t.parallel.ep == 1  # expert adapters are not split over expert-parallel ranks
            wrapped = lora.apply_lora(model, t.lora.rank, t.lora.alpha, t.lora.target_modules, experts=experts)
            log(lora.describe(model, wrapped, t.lora.rank, t.lora.alpha)
                + ("" if experts else "; the routed experts stay frozen with trainer.parallel.ep > 1"))
            if resume is not None:
                try:
                    lora.load_adapter(model, resume[1] / lora.ADAPTER_DIR)
                except PrimerlError:
                    raise
                except Exception as exc:  # whatever a damaged file raises
                    raise unloadable(run, resume[0], exc) from exc
        settings = t.parallel.resolved(world_size())
        with device_mesh(parallelism.mesh_shape(world_size(), settings), device) as mesh:
            model, optimizer, layout = parallelism.parallelize(
                model, mesh, lambda m: make_optimizer(m, t.lr, t.weight_decay))
            log(f"parallelism {layout.describe()}")
            train(cfg, run, model, optimizer, loss_fn, parallelism, correction=correction, adapter=adapter, tokenizer=tokenizer,
                  resume=resume, monitors=monitors)
    finally:
        try:
            monitors.finish()  # reward.png, and every dashboard flushed, also when the trainer fails
        finally:
            if owns_group:
                import torch.distributed as dist

                dist.destroy_process_group()


def share_prompts(cfg: RunConfig, model: torch.nn.Module) -> bool:
    """Whether this trainer packs prompt trees (``trainer.share_prompts``): not with
    recurrent layers, whose state cannot branch after a shared prompt (logged once)."""
    if not cfg.trainer.share_prompts:
        return False
    if any(spec.get("state") for spec in model.cache_layout()):
        log("trainer.share_prompts: this model has recurrent (Mamba) layers, whose state cannot branch "
            "after a shared prompt; every sample is packed whole")
        return False
    return True


class Publisher:
    """Publishes policy v(n) for inference as ``weights/step_n`` over ``trainer.weight_channel``.
    The nccl channel's sender is made once v0 is on disk and the servers have started from
    it (until then weights go through the filesystem); a full disk is one line and the way
    back."""

    def __init__(self, cfg: RunConfig, run: RunDir, model: torch.nn.Module, *, adapter: Any, tokenizer: Any,
                 parallelism: Parallelism) -> None:
        self.cfg, self.run, self.model = cfg, run, model
        self.adapter, self.tokenizer, self.parallelism = adapter, tokenizer, parallelism
        self.sender: Any = None  # the nccl channel's (primerl.inference.WeightSender)

    def __call__(self, n: int) -> None:
        channel, run = self.cfg.trainer.weight_channel, self.run
        if channel == "nccl" and self.sender is None and run.published(0) and is_publisher():
            self.sender = weight_sender(self.cfg)
        try:
            publish_weights(run, n, self.model, adapter=self.adapter, tokenizer=self.tokenizer,
                            parallelism=self.parallelism,
                            channel="filesystem" if channel == "nccl" and self.sender is None else channel,
                            sender=self.sender)
        except OSError as exc:  # a full disk: one line, and the way back
            last = run.checkpoint_steps()
            raise PrimerlError(
                f"could not publish weights/{step_name(n)}: {exc.strerror or exc}"
                + (f" ({exc.filename})" if exc.filename else "") + "; the same command resumes from "
                + (f"checkpoints/{step_name(last[-1])}" if last else "the start")) from exc

    def close(self) -> None:
        """After the last step: the shm channel's file released, the nccl sender closed."""
        if self.cfg.trainer.weight_channel == "shm" and is_publisher():
            release_shm(self.run)
        if self.sender is not None:
            self.sender.close()


def begin(cfg: RunConfig, run: RunDir, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
          parallelism: Parallelism, publish: Publisher, *, resume: tuple[int, Path] | None, tokenizer: Any,
          join: bool) -> int:
    """The step training continues after. From a checkpoint: its optimizer, scheduler and RNG
    state, ``metrics.jsonl`` trimmed to it, its weights published again if they are gone.
    Otherwise: an earlier attempt's metrics set aside, the SFT warm-up, v0 published."""
    if is_publisher():
        run.remove_partial_writes()  # left by a trainer that died mid-write
    if resume is None:
        if is_publisher() and (kept := trim_metrics(run, 0)) is not None:
            log(f"no checkpoint to resume from: an earlier attempt's metrics.jsonl is kept as {kept}")
        if cfg.sft.steps > 0:
            watchdog.doing("the SFT warm-up", busy=True)
            sft_warmup(cfg, model, tokenizer, parallelism, join=join)
            seed_everything(cfg.seed)  # RL draws the same randomness with or without SFT
        publish(0)
        log(f"published weights/{step_name(0)} (v0{' after SFT' if cfg.sft.steps else ''})")
        return 0
    try:
        start = load_resume_state(resume[1], model, optimizer, scheduler, parallelism=parallelism)
    except PrimerlError:
        raise
    except (Exception, CheckpointException) as exc:  # whatever a damaged file raises (DCP's: a BaseException)
        raise unloadable(run, resume[0], exc) from exc
    log(f"resumed from {resume[1]} (step {start})")
    if is_publisher() and (kept := trim_metrics(run, start)) is not None:
        log(f"metrics.jsonl: lines after step {start} dropped (they are trained again); the whole file is "
            f"kept as {kept}")
    republish = not run.published(start)
    barrier()  # every rank has looked before rank 0 may publish: they must agree
    if republish:
        publish(start)
        log(f"republished weights/{step_name(start)}")
    return start


@attrs.frozen
class StepTimes:
    """When a step's phases began and ended (``time.perf_counter``)."""

    waiting: float  # it began waiting for its batch
    started: float  # the batch was there: the trainer's own time starts
    publishing: float  # the optimizer step was done: publishing began
    ended: float  # the weights were published
    previous_end: float | None  # the previous step's end (None: the first step of this process)
    checkpoint_s: float  # the previous step's checkpoint write, part of this step's wall time

    @property
    def wall(self) -> float:
        """From the previous step's end (or this one's wait) to this one's end."""
        return self.ended - (self.previous_end if self.previous_end is not None else self.waiting)

    @property
    def train(self) -> float:
        return self.ended - self.started


def step_record(n: int, batch: RolloutBatch, packed: PackedBatch, stats: dict[str, float], lr: float,
                times: StepTimes) -> dict[str, Any]:
    """Step ``n``'s line of ``metrics.jsonl``: the orchestrator's batch figures, then the trainer's."""
    sampled = sum(s.sampled_tokens for s in batch.samples)
    return {
        **batch.metrics,
        "step": n,
        "policy_version": n,
        **stats,
        "lr": lr,
        "time/step": times.wall,  # wall time of this step: from the previous step's end (or this one's wait) to its end
        # the tokens the policy sampled for this step's batch per second of that wall time
        "throughput/sampled_tokens_per_s": sampled / max(times.wall, 1e-9),
        "time/train": times.train,  # the trainer's own compute, batch in hand to weights published
        "time/wait": times.started - times.waiting,
        "time/publish": times.ended - times.publishing,  # of time/train: the weights written for inference
        "time/checkpoint": times.checkpoint_s,  # of time/step: the previous step's resumable checkpoint written
        "time/end": time.time(),
        "trainer/tokens_per_s": packed.num_tokens / max(times.train, 1e-9),
        "trainer/tokens": packed.num_tokens,
        # positions the shared prompts saved (the samples' own positions minus those run)
        "trainer/shared_tokens": sum(max(len(s.tokens) - 1, 0) for s in batch.samples) - packed.num_tokens,
        "trainer/loss_tokens": packed.num_loss_tokens,
        "trainer/rows": packed.num_rows,
    }


def step_line(n: int, max_steps: int, batch: RolloutBatch, packed: PackedBatch, stats: dict[str, float], lr: float,
              times: StepTimes) -> str:
    """Step ``n``'s log line."""
    return (f"step {n}/{max_steps} samples {len(batch.samples)} rows {packed.num_rows} "
            f"tokens {packed.num_tokens} loss {stats['loss']:.4f} mismatch_kl {stats['mismatch_kl']:.2e} "
            f"masked {stats['masked_fraction']:.3f} "
            + (f"clipped {stats['clipped_fraction']:.3f} " if "clipped_fraction" in stats else "")
            + f"grad_norm {stats['grad_norm']:.3f} lr {lr:.2e} "
            f"step {times.train:.2f}s wait {times.started - times.waiting:.2f}s"
            + (f" routing_agreement {stats['routing_agreement']:.3f}" if "routing_agreement" in stats else ""))


def checkpoint(cfg: RunConfig, run: RunDir, n: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               scheduler: Any, *, adapter: Any, tokenizer: Any, parallelism: Parallelism) -> float:
    """``checkpoints/step_n`` when one is due (every ``trainer.checkpoint_every`` steps and at
    the end), the oldest beyond ``trainer.keep_checkpoints`` deleted; the seconds it took."""
    t = cfg.trainer
    if not ((t.checkpoint_every and n % t.checkpoint_every == 0) or n == cfg.max_steps):
        return 0.0
    t_checkpoint = time.perf_counter()
    save_checkpoint(run, n, model, optimizer, scheduler, adapter=adapter, tokenizer=tokenizer, parallelism=parallelism)
    pruned = prune_checkpoints(run, n, t.keep_checkpoints) if is_publisher() else []
    seconds = time.perf_counter() - t_checkpoint
    log(f"saved checkpoints/{step_name(n)}"
        + (f"; deleted {', '.join(step_name(m) for m in pruned)} (keep_checkpoints {t.keep_checkpoints})"
           if pruned else ""))
    return seconds


def train(cfg: RunConfig, run: RunDir, model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Loss,
          parallelism: Parallelism, *, correction: Correction | None = None, adapter: Any, tokenizer: Any,
          resume: tuple[int, Path] | None, monitors: MonitorSet) -> None:
    """Resume or start (SFT, v0), then one RL step per batch until ``max_steps``: wait for
    it, pack it, step, publish, log its metrics, checkpoint when due."""
    join = adapter.capabilities(cfg.model).varlen_rows  # each forward's rows as one, without padding
    t = cfg.trainer
    scheduler = make_scheduler(optimizer, cfg)
    publish = Publisher(cfg, run, model, adapter=adapter, tokenizer=tokenizer, parallelism=parallelism)
    start = begin(cfg, run, model, optimizer, scheduler, parallelism, publish, resume=resume, tokenizer=tokenizer,
                  join=join)
    monitors.start(RunInfo(output_dir=run.root, name=run.root.resolve().name, config=to_dict(cfg), start_step=start,
                           max_steps=cfg.max_steps, log=log))
    keep = cfg.orchestrator.max_off_policy_steps + 2
    share = share_prompts(cfg, model)
    replay_warned = False
    last_end = None
    checkpoint_s = 0.0  # the previous step's checkpoint write (part of this step's wall time)
    for n in range(start + 1, cfg.max_steps + 1):
        t_wait = time.perf_counter()
        watchdog.doing(f"step {n} of {cfg.max_steps}")
        with watchdog.waiting("batch", f"batch {n} ({run.batch(n).relative_to(run.root)}) from the orchestrator"):
            wait_for(run.batch(n))
        t_start = time.perf_counter()  # the batch is available: time/step starts here
        batch = read_batch(run.batch(n))
        packed = pack(batch.samples, t.seq_len, share_prompts=share)
        if t.router_replay and packed.replay_experts is None and not replay_warned:
            log("trainer.router_replay is on but the batch's samples carry no routed_experts: not replaying")
            replay_warned = True
        lr = optimizer.param_groups[0]["lr"]
        stats = rl_step(model, optimizer, packed, loss_fn, cfg, parallelism, correction, join=join)
        scheduler.step()
        t_publish = time.perf_counter()
        with watchdog.waiting("publish", f"publishing weights v{n}"):
            publish(n)
        times = StepTimes(waiting=t_wait, started=t_start, publishing=t_publish, ended=time.perf_counter(),
                          previous_end=last_end, checkpoint_s=checkpoint_s)
        if is_publisher():
            prune_weights(run, n, keep)
        monitors.log(n, step_record(n, batch, packed, stats, lr, times))  # metrics.jsonl first, then the others
        if monitors.wants_samples(n):
            monitors.log_samples(n, sample_rows(n, batch.samples, tokenizer))
        watchdog.advance()
        last_end = times.ended
        log(step_line(n, cfg.max_steps, batch, packed, stats, lr, times))
        checkpoint_s = checkpoint(cfg, run, n, model, optimizer, scheduler, adapter=adapter, tokenizer=tokenizer,
                                  parallelism=parallelism)
    publish.close()
    log(f"done: {cfg.max_steps} steps")
