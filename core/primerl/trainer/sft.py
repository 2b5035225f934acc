"""The optional supervised warm-up before RL (``[sft]``): cross-entropy on reference answers.

What: ``sft.steps`` steps, each on ``sft.batch_size`` tasks of the env's ``train`` split
(cycled), with its own AdamW at ``sft.lr``. A sample is the chat-template prompt (with
the generation prompt) followed by the reference answer and eos; the loss covers the
answer and eos only. Samples are :class:`primerl.samples.Sample` records packed exactly
as RL batches are, so the forward is the RL one.

Why: a fresh tiny model earns no reward at all; a short warm-up gives RL something to
improve. A pretrained checkpoint skips it (``sft.steps = 0``). With LoRA (``[trainer.lora]``)
the warm-up trains the model's own weights, not the adapters: it makes the starting point
that RL's adapters then adapt (and that checkpoints hold as the adapters' base).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any

import torch

from primerl.config import RunConfig
from primerl.envs.multiturn import prompt_ids
from primerl.parallel import Parallelism, world_size
from primerl.samples import Sample
from primerl.trainer import log
from primerl.trainer.optim import make_optimizer
from primerl.trainer.packing import pack
from primerl.trainer.step import RouterBalancer, compute_precision, micro_batches, row_forward


def sft_samples(env: Any, tasks: list[Any], tokenizer: Any) -> list[Sample]:
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
        samples.append(Sample(tokens=prompt + answer, loss_mask=[0] * len(prompt) + [1] * len(answer),
                              task_id=task.id))
    return samples


def sft_warmup(cfg: RunConfig, model: torch.nn.Module, tokenizer: Any, parallelism: Parallelism, *,
               join: bool = False) -> None:
    """``sft.steps`` steps of cross-entropy on answer tokens, ``sft.batch_size`` tasks each
    (``join``: each forward's rows as one row, as in :func:`primerl.trainer.step.rl_step`)."""
    from primerl.lora import is_adapter
    from primerl.registry import get_registry

    env = get_registry().load("env", cfg.env.name)(cfg.env)
    trains = {n: p.requires_grad for n, p in model.named_parameters()}  # RL's choice, restored after
    if cfg.trainer.lora.rank:  # the model's own weights train here; the adapters (still zero) wait for RL
        for n, p in model.named_parameters():
            p.requires_grad_(not is_adapter(n))
    try:
        _warm_up(cfg, model, tokenizer, parallelism, env, join)
    finally:
        for n, p in model.named_parameters():
            p.requires_grad_(trains[n])


def _warm_up(cfg: RunConfig, model: torch.nn.Module, tokenizer: Any, parallelism: Parallelism, env: Any,
             join: bool) -> None:
    s = cfg.sft
    optimizer = make_optimizer(model, s.lr, cfg.trainer.weight_decay)
    balancer = RouterBalancer(model, cfg.trainer.router_bias_update_rate, parallelism)

    def cycle() -> Iterator[Any]:
        while True:
            empty = True
            for task in env.tasks("train"):
                empty = False
                yield task
            if empty:
                raise ValueError(f"env {cfg.env.name!r} has no 'train' tasks for the SFT warm-up")

    tasks = cycle()
    alone = world_size() == 1  # with other ranks, every forward runs: they wait for its collectives
    log(f"SFT warm-up: {s.steps} steps of {s.batch_size} tasks, lr {s.lr}")
    t0 = time.perf_counter()
    for step in range(1, s.steps + 1):
        packed = pack(sft_samples(env, list(itertools.islice(tasks, s.batch_size)), tokenizer), cfg.trainer.seq_len)
        normalizer = float(max(packed.num_loss_tokens, 1))
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for row in micro_batches(packed, parallelism, cfg.trainer.micro_batch_rows,
                                 torch.device(cfg.trainer.resolved_device()), join=join):
            real = row["sample_index"] >= 0  # [k, m]: tokens of samples
            mask = row["loss_mask"] & real  # [k, m]
            if alone and not bool(mask.any()):
                continue
            lp, out = row_forward(model, row, replay=False, precision=compute_precision(cfg.trainer))  # [k, m]
            balancer.observe(out.router_experts, real)
            loss = -(lp * mask).sum() / normalizer
            loss.backward()
            total += float(loss.detach())
        grad_norm = parallelism.clip_grad_norm_(model, cfg.trainer.max_grad_norm)
        total = float(parallelism.sum_over_ranks(torch.tensor([total], dtype=torch.float64))[0])
        optimizer.step()
        balancer.step()
        if step == 1 or step == s.steps or step % 10 == 0:
            log(f"sft step {step}/{s.steps} loss {total:.4f} grad_norm {grad_norm:.3f} "
                f"({time.perf_counter() - t0:.1f}s)")
    optimizer.zero_grad(set_to_none=True)
