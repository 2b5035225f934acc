"""The optimizer and its learning-rate schedule (shared by the RL steps and the SFT warm-up).

AdamW with weight decay on matrices only, and a multiplier of the base LR per optimizer
step: linear warm-up, then constant, cosine or linear decay to 0 at ``max_steps``.

On the CPU, AdamW runs fused (``fused=True``: one kernel per parameter instead of about ten
ops, a quarter of the time for the tiny presets' 70 tensors); the numbers differ from the
per-op loop only in float rounding. Sharded parameters (DTensors, FSDP) and other devices
keep torch's default implementation, whatever a checkpoint's optimizer state was written
with (:class:`AdamW` keeps its own choice when it loads one).
"""

from __future__ import annotations

import math

import torch

from primerl.config import RunConfig


class AdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` that keeps its implementation (``fused``, ``foreach``) when it
    loads a state dict: a checkpoint written by a fused optimizer (one CPU process) may be
    resumed by FSDP ranks, whose DTensor parameters need the default one, and back."""

    def load_state_dict(self, state_dict: dict) -> None:
        impl = [(g["fused"], g["foreach"]) for g in self.param_groups]
        super().load_state_dict(state_dict)
        for group, (fused, foreach) in zip(self.param_groups, impl, strict=True):
            group["fused"], group["foreach"] = fused, foreach


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW; matrices decay, vectors (norm weights, biases) do not; fused on the CPU."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = bool(params) and all(type(p) is torch.nn.Parameter and p.device.type == "cpu" for p in params)
    return AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8, fused=fused or None)


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
