"""The trainer process: ``primerl trainer @ OUT/config.toml`` calls :func:`main`.

What it does, in order (files per docs/architecture.md):

1. Build the model (float32, whatever dtype inference serves in) from the model plugin,
   AdamW and the LR schedule. Resume from the newest ``OUT/checkpoints/step_N`` if any.
2. Otherwise: optional SFT warm-up on the env's reference answers (``[sft]``), then
   publish v0 as ``OUT/weights/step_000000`` so the orchestrator can start.
3. For n = start+1 .. max_steps: wait for ``OUT/rollouts/step_n.pt``, pack it, one
   optimizer step (gradients accumulated over packed rows, one row per forward), publish
   ``weights/step_n`` + ``STABLE``, prune old weights, append a line to ``metrics.jsonl``,
   checkpoint every ``trainer.checkpoint_every`` steps and at the end.

Why this shape: the trainer never talks to the other processes except through files that
appear atomically (written under a temporary name, then renamed), so it runs unchanged
on one laptop or on a cluster with a shared filesystem. Logprobs are computed with
``primerl.sampling.token_logprobs``, the engine's own function, so the importance ratio
is 1 when trainer and engine hold the same weights.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any

import attrs
import torch

from primerl.config import RunConfig
from primerl.envs.multiturn import prompt_ids
from primerl.rundir import SHM_LINK, STABLE, step_name
from primerl.sampling import token_logprobs
from primerl.trainer.loss import get_loss
from primerl.trainer.packing import PackedBatch, pack

POLL_S = 0.05
STEP_DIR = re.compile(r"step_(\d{6})$")
STATE_NAME = "trainer_state.pt"


def log(msg: str) -> None:
    print(f"[trainer] {msg}", flush=True)


# --------------------------------------------------------------------------------------
# Setup
# --------------------------------------------------------------------------------------


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


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW; matrices decay, vectors (norm weights, biases) do not."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8)


def lr_factor(step: int, warmup: int, total: int, schedule: str) -> float:
    """Multiplier of the base LR for 0-based optimizer step ``step`` of ``total``.

    Linear warm-up over ``warmup`` steps (from 1/warmup to 1), then constant, or a cosine
    or linear decay towards 0 at step ``total``.
    """
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "linear":
        return 1.0 - progress
    raise ValueError(f"unknown trainer.lr_schedule {schedule!r}")


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: RunConfig) -> torch.optim.lr_scheduler.LambdaLR:
    t = cfg.trainer
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, t.warmup_steps, cfg.max_steps, t.lr_schedule)
    )


# --------------------------------------------------------------------------------------
# Forward / loss over packed rows
# --------------------------------------------------------------------------------------


def row_forward(model: torch.nn.Module, row: dict[str, torch.Tensor | None], replay: bool) -> tuple[torch.Tensor, Any]:
    """Trainer logprobs of packed rows' targets ([k, m]; row tensors are [k, m, ...]) and the
    model output (for its routing)."""
    out = model(
        row["input_ids"],
        row["positions"],
        row["lengths"],
        segment_ids=row["segment_ids"],
        replay_experts=row["replay_experts"] if replay else None,
        logits_for="all",
    )
    # logits [k, m, V]; temperature per position [k, m]
    return token_logprobs(out.logits, row["targets"], row["temperatures"]), out


def routing_agreement(own: torch.Tensor, inference: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Per MoE layer, how many valid tokens the trainer's routers send to exactly the experts
    inference used (as sets). own, inference: [k, m, L, top_k]; valid: [k, m] bool. Returns [L]."""
    same = (own.sort(-1).values == inference.to(own.dtype).sort(-1).values).all(-1)  # [k, m, L]
    return (same & valid[..., None]).sum((0, 1))


class RouterBalancer:
    """Aux-loss-free load balancing (DeepSeek-V3): after each optimizer step, every sigmoid
    router's ``e_score_correction_bias`` moves by ``rate`` towards its under-loaded experts
    (+rate) and away from its over-loaded ones (-rate), counted over the step's tokens.

    The bias steers which experts are chosen, never their weights, so it needs no
    gradient. ``rate`` 0 (the default for RL from a pretrained checkpoint) leaves routing
    alone; pretraining-style runs use about 1e-3.
    """

    def __init__(self, model: torch.nn.Module, rate: float) -> None:
        self.rate = rate
        self.routers = [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]
        self.loads: torch.Tensor | None = None  # [L, E] tokens per expert this step

    def observe(self, router_experts: torch.Tensor, valid: torch.Tensor) -> None:
        """router_experts: [k, m, L, top_k] the routers' own choice; valid: [k, m] bool."""
        if not self.rate or not self.routers:
            return
        ids = router_experts[valid].long().permute(1, 0, 2).flatten(1)  # [L, n * top_k]
        E = self.routers[0].e_score_correction_bias.shape[0]
        loads = torch.zeros(ids.shape[0], E).scatter_add_(1, ids, torch.ones(ids.shape, dtype=torch.float32))
        self.loads = loads if self.loads is None else self.loads + loads

    @torch.no_grad()
    def step(self) -> None:
        if self.loads is not None:
            for router, load in zip(self.routers, self.loads, strict=True):
                bias = router.e_score_correction_bias
                bias += self.rate * torch.sign(load.mean() - load).to(bias.device, bias.dtype)
        self.loads = None


def rl_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    packed: PackedBatch,
    loss_fn: Any,
    cfg: RunConfig,
) -> dict[str, float]:
    """One optimizer step over every packed row (gradient accumulation, one row per forward)."""
    t = cfg.trainer
    n_loss = packed.num_loss_tokens
    normalizer = float(max(n_loss, 1))
    replay = t.router_replay and packed.replay_experts is not None
    optimizer.zero_grad(set_to_none=True)
    total_loss = 0.0
    sums: dict[str, float] = {}
    agreed, routed_tokens = None, 0  # per-layer token counts of trainer/inference routing agreement
    balancer = RouterBalancer(model, t.router_bias_update_rate)
    # several rows per forward: fewer, larger ops (CPU time is mostly per-op overhead)
    for r in range(0, packed.num_rows, t.micro_batch_rows):
        row = packed.rows(r, min(r + t.micro_batch_rows, packed.num_rows))
        k, m = row["input_ids"].shape
        valid = (torch.arange(m)[None, :] < row["lengths"][:, None]).flatten()  # [k*m]
        mask = row["loss_mask"].flatten()[valid]  # [n]
        if not bool(mask.any()):
            continue  # nothing to learn from these rows
        lp, out = row_forward(model, row, replay)
        balancer.observe(out.router_experts, valid.view(k, m))
        lp = lp.flatten()[valid]  # [n]
        if t.routing_metrics and row["replay_experts"] is not None and out.router_experts.shape[2]:
            agree = routing_agreement(out.router_experts, row["replay_experts"], valid.view(k, m))
            agreed = agree if agreed is None else agreed + agree
            routed_tokens += int(valid.sum())
        loss, metrics = loss_fn(
            lp,
            row["inference_logprobs"].flatten()[valid],
            row["advantages"].flatten()[valid],
            mask,
            config=t,
            normalizer=normalizer,
        )
        loss.backward()
        total_loss += float(loss.detach())
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + float(v)
    params = [p for p in model.parameters() if p.grad is not None]
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, t.max_grad_norm)) if params else 0.0
    optimizer.step()
    balancer.step()
    out = {k: v / normalizer for k, v in sums.items()}
    out.setdefault("mismatch_kl", 0.0)
    out.setdefault("masked_fraction", 0.0)
    out.update(loss=total_loss, grad_norm=grad_norm)
    if agreed is not None and routed_tokens:
        per_layer = (agreed.double() / routed_tokens).tolist()
        out["routing_agreement"] = sum(per_layer) / len(per_layer)
        out.update({f"routing_agreement/layer_{i}": v for i, v in enumerate(per_layer)})
    return out


# --------------------------------------------------------------------------------------
# SFT warm-up
# --------------------------------------------------------------------------------------


def sft_samples(env: Any, tasks: list[Any], tokenizer: Any) -> list[dict[str, Any]]:
    """Prompt (chat template, generation prompt) + answer + eos; loss on answer and eos only."""
    samples = []
    for task in tasks:
        if task.answer is None:
            raise ValueError(
                f"sft.steps > 0 needs reference answers, but task {task.id!r} of env "
                f"{type(env).__name__} has none: set --sft.steps 0"
            )
        prompt = prompt_ids(tokenizer, task.messages(env.system_prompt))
        answer = list(tokenizer.encode(task.answer, add_special_tokens=False)) + [tokenizer.eos_token_id]
        samples.append({"tokens": prompt + answer, "loss_mask": [0] * len(prompt) + [1] * len(answer)})
    return samples


def sft_warmup(cfg: RunConfig, model: torch.nn.Module, tokenizer: Any) -> None:
    """``sft.steps`` steps of cross-entropy on answer tokens, ``sft.batch_size`` tasks each."""
    from primerl.registry import get_registry

    env = get_registry().load("env", cfg.env.name)(cfg.env)
    s = cfg.sft
    optimizer = make_optimizer(model, s.lr, cfg.trainer.weight_decay)
    balancer = RouterBalancer(model, cfg.trainer.router_bias_update_rate)

    def cycle():
        while True:
            empty = True
            for task in env.tasks("train"):
                empty = False
                yield task
            if empty:
                raise ValueError(f"env {cfg.env.name!r} has no 'train' tasks for the SFT warm-up")

    tasks = cycle()
    log(f"SFT warm-up: {s.steps} steps of {s.batch_size} tasks, lr {s.lr}")
    t0 = time.perf_counter()
    for step in range(1, s.steps + 1):
        packed = pack(sft_samples(env, list(itertools.islice(tasks, s.batch_size)), tokenizer), cfg.trainer.seq_len)
        normalizer = float(max(packed.num_loss_tokens, 1))
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for r in range(0, packed.num_rows, cfg.trainer.micro_batch_rows):
            row = packed.rows(r, min(r + cfg.trainer.micro_batch_rows, packed.num_rows))
            mask = row["loss_mask"]  # [k, m]; padding is never a loss token
            if not bool(mask.any()):
                continue
            lp, out = row_forward(model, row, replay=False)  # [k, m]
            balancer.observe(out.router_experts, row["lengths"][:, None] > torch.arange(mask.shape[1]))
            loss = -(lp * mask).sum() / normalizer
            loss.backward()
            total += float(loss.detach())
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.trainer.max_grad_norm))
        optimizer.step()
        balancer.step()
        if step == 1 or step == s.steps or step % 10 == 0:
            log(f"sft step {step}/{s.steps} loss {total:.4f} grad_norm {grad_norm:.3f} "
                f"({time.perf_counter() - t0:.1f}s)")
    optimizer.zero_grad(set_to_none=True)


# --------------------------------------------------------------------------------------
# Files: weights, checkpoints, batches, metrics
# --------------------------------------------------------------------------------------


def _write_dir_atomically(final: Path, write) -> None:
    """Call ``write(tmp_dir)``, then rename the temporary directory to ``final``."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".tmp_{final.name}_{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    write(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)


def shm_dir(out: Path) -> Path:
    """Where the shm channel keeps this run's weights: tmpfs, one folder per run directory."""
    import hashlib

    return Path("/dev/shm") / f"primerl-{hashlib.sha1(str(out.resolve()).encode()).hexdigest()[:12]}"


def publish_weights(adapter: Any, model: torch.nn.Module, tokenizer: Any, out: Path, n: int,
                    channel: str = "filesystem") -> Path:
    """``OUT/weights/step_n/``, then its empty ``STABLE`` file.

    ``filesystem``: an HF checkpoint + tokenizer (any server that sees the run directory
    loads it). ``shm``: one safetensors file of the model's own tensors in /dev/shm, linked
    from ``step_n/shm.safetensors``; a server on this machine adopts it without a copy.
    """
    final = out / "weights" / step_name(n)
    if channel == "shm":
        from primerl.weights import write_safetensors

        shm = shm_dir(out)
        shm.mkdir(parents=True, exist_ok=True)
        target = shm / f"{step_name(n)}.safetensors"
        write_safetensors(model.state_dict(), target)
        def link(d: Path) -> None:
            d.mkdir(parents=True, exist_ok=True)
            (d / SHM_LINK).symlink_to(target)

        _write_dir_atomically(final, link)
    else:
        _write_dir_atomically(final, lambda d: adapter.save_checkpoint(model, d, tokenizer))
    (final / STABLE).touch()
    return final


def prune_weights(out: Path, n: int, keep_steps: int) -> list[int]:
    """Delete ``weights/step_m`` for m < n - keep_steps. Returns the deleted steps."""
    deleted = []
    root = out / "weights"
    if not root.is_dir():
        return deleted
    for d in root.iterdir():
        m = STEP_DIR.match(d.name)
        if m and int(m.group(1)) < n - keep_steps:
            link = d / SHM_LINK
            if link.is_symlink():
                Path(os.readlink(link)).unlink(missing_ok=True)  # the tmpfs file behind it
            shutil.rmtree(d, ignore_errors=True)
            deleted.append(int(m.group(1)))
    return sorted(deleted)


def save_checkpoint(
    adapter: Any, model: torch.nn.Module, tokenizer: Any, optimizer: Any, scheduler: Any, out: Path, n: int
) -> Path:
    """``OUT/checkpoints/step_n/``: HF weights + ``trainer_state.pt`` (optimizer, scheduler, step, RNG)."""

    def write(d: Path) -> None:
        adapter.save_checkpoint(model, d, tokenizer)
        state = {
            "step": n,
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
        }
        torch.save(state, d / STATE_NAME)

    final = out / "checkpoints" / step_name(n)
    _write_dir_atomically(final, write)
    return final


def latest_checkpoint(out: Path) -> tuple[int, Path] | None:
    """The newest complete ``OUT/checkpoints/step_N`` (one with a trainer_state.pt), or None."""
    root = out / "checkpoints"
    if not root.is_dir():
        return None
    found = [
        (int(m.group(1)), d)
        for d in root.iterdir()
        if (m := STEP_DIR.match(d.name)) and (d / STATE_NAME).is_file()
    ]
    return max(found) if found else None


def load_resume_state(
    adapter: Any, model: torch.nn.Module, optimizer: Any, scheduler: Any, ckpt: Path
) -> int:
    """Restore weights, optimizer, scheduler and RNG from a checkpoint; returns its step."""
    adapter.load_checkpoint(model, ckpt)
    state = torch.load(ckpt / STATE_NAME, map_location="cpu", weights_only=False)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"])
    random.setstate(state["python_rng"])
    return int(state["step"])


def wait_for(path: Path) -> None:
    """Poll until the orchestrator has renamed the batch into place."""
    while not path.exists():
        time.sleep(POLL_S)


def load_batch(path: Path) -> dict[str, Any]:
    # Our own orchestrator's file in the run directory; not weights_only because batch
    # metrics may hold numpy scalars.
    return torch.load(path, map_location="cpu", weights_only=False)


def _json_value(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else v.tolist()
    if hasattr(v, "item"):  # numpy scalars
        return v.item()
    if hasattr(v, "tolist"):
        return v.tolist()
    return str(v)


def append_metrics(out: Path, record: dict[str, Any]) -> None:
    line = json.dumps(record, default=_json_value) + "\n"
    with open(out / "metrics.jsonl", "a") as f:  # one write per line
        f.write(line)


def truncate_metrics(out: Path, last_step: int) -> None:
    """Drop metric lines of steps after ``last_step`` (redone after a resume), atomically."""
    path = out / "metrics.jsonl"
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if int(json.loads(line).get("step", 0)) <= last_step:
                kept.append(line + "\n")
        except (ValueError, AttributeError):
            continue
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------
# The process
# --------------------------------------------------------------------------------------


def main(cfg: RunConfig) -> None:
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    seed_everything(cfg.seed)
    t = cfg.trainer
    loss_fn = get_loss(t.loss)  # fail fast on a bad name

    adapter, model, tokenizer = build_model(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model {cfg.model.name} ({cfg.model.preset if cfg.model.checkpoint is None else cfg.model.checkpoint}), "
        f"{n_params / 1e6:.2f}M parameters, float32")
    optimizer = make_optimizer(model, t.lr, t.weight_decay)
    scheduler = make_scheduler(optimizer, cfg)

    for stale in [*out.glob("weights/.tmp_*"), *out.glob("checkpoints/.tmp_*")]:
        shutil.rmtree(stale, ignore_errors=True)  # left by a trainer that died mid-write
    start = 0
    resume = latest_checkpoint(out)
    if resume is not None:
        start = load_resume_state(adapter, model, optimizer, scheduler, resume[1])
        log(f"resumed from {resume[1]} (step {start})")
        truncate_metrics(out, start)
        if not (out / "weights" / step_name(start) / STABLE).exists():
            publish_weights(adapter, model, tokenizer, out, start, cfg.trainer.weight_channel)
            log(f"republished weights/{step_name(start)}")
    else:
        if cfg.sft.steps > 0:
            sft_warmup(cfg, model, tokenizer)
            seed_everything(cfg.seed)  # RL draws the same randomness with or without SFT
        publish_weights(adapter, model, tokenizer, out, 0, cfg.trainer.weight_channel)
        log(f"published weights/{step_name(0)} (v0{' after SFT' if cfg.sft.steps else ''})")

    keep = cfg.orchestrator.max_off_policy_steps + 2
    replay_warned = False
    last_end = None
    for n in range(start + 1, cfg.max_steps + 1):
        path = out / "rollouts" / f"{step_name(n)}.pt"
        t_wait = time.perf_counter()
        wait_for(path)
        t_start = time.perf_counter()  # the batch is available: time/step starts here
        batch = load_batch(path)
        samples = batch["samples"]
        packed = pack(samples, t.seq_len)
        if t.router_replay and packed.replay_experts is None and not replay_warned:
            log("trainer.router_replay is on but the batch's samples carry no routed_experts: not replaying")
            replay_warned = True
        lr = optimizer.param_groups[0]["lr"]
        stats = rl_step(model, optimizer, packed, loss_fn, cfg)
        scheduler.step()
        publish_weights(adapter, model, tokenizer, out, n, cfg.trainer.weight_channel)
        t_end = time.perf_counter()
        prune_weights(out, n, keep)

        step_s = t_end - t_start
        record = {
            **batch.get("metrics", {}),
            "step": n,
            "policy_version": n,
            **stats,
            "lr": lr,
            "time/step": t_end - (last_end if last_end is not None else t_wait),  # wall time of this step
            "time/train": step_s,  # the trainer's own compute, batch in hand to weights published
            "time/wait": t_start - t_wait,
            "time/end": time.time(),
            "trainer/tokens_per_s": packed.num_tokens / max(step_s, 1e-9),
            "trainer/tokens": packed.num_tokens,
            "trainer/loss_tokens": packed.num_loss_tokens,
            "trainer/rows": packed.num_rows,
        }
        append_metrics(out, record)
        last_end = t_end
        log(f"step {n}/{cfg.max_steps} samples {len(samples)} rows {packed.num_rows} tokens {packed.num_tokens} "
            f"loss {stats['loss']:.4f} mismatch_kl {stats['mismatch_kl']:.2e} masked {stats['masked_fraction']:.3f} "
            f"grad_norm {stats['grad_norm']:.3f} lr {lr:.2e} step {step_s:.2f}s wait {t_start - t_wait:.2f}s"
            + (f" routing_agreement {stats['routing_agreement']:.3f}" if "routing_agreement" in stats else ""))

        if (t.checkpoint_every and n % t.checkpoint_every == 0) or n == cfg.max_steps:
            save_checkpoint(adapter, model, tokenizer, optimizer, scheduler, out, n)
            log(f"saved checkpoints/{step_name(n)}")

    if cfg.trainer.weight_channel == "shm":
        shutil.rmtree(shm_dir(out), ignore_errors=True)  # tmpfs is RAM; checkpoints/ keeps the result
    log(f"done: {cfg.max_steps} steps")
