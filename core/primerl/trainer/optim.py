"""The optimizer and its learning-rate schedule (shared by the RL steps and the SFT warm-up).

AdamW with weight decay on matrices only, and a multiplier of the base LR per optimizer
step: linear warm-up, then constant, cosine or linear decay to 0 at ``max_steps``.
"""

from __future__ import annotations

import math

import torch

from primerl.config import RunConfig


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
