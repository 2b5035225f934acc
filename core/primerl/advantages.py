"""Advantage estimators: one group's rewards in, one advantage per reward out.

``orchestrator.advantage`` names a component registered through the ``register_advantages``
hook (the core's own plugin registers ``grpo`` and ``grpo_std``) or any ``"module:attr"``
function. The orchestrator computes advantages when it writes a batch, so this module is
pure Python: no torch.

The contract: ``fn(rewards: list[float]) -> list[float]`` for one group (one value per
reward, same order).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from primerl.registry import resolve_component

AdvantageFn = Callable[[list[float]], list[float]]  # one group's rewards -> one advantage each


def grpo(rewards: list[float]) -> list[float]:
    """Reward minus the group mean (Dr. GRPO: no division by the std)."""
    mean = sum(rewards) / len(rewards)
    return [r - mean for r in rewards]


def grpo_std(rewards: list[float]) -> list[float]:
    """(reward - group mean) / (group std + 1e-6), std over the group (population, ddof=0)."""
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    return [(r - mean) / (std + 1e-6) for r in rewards]


def compute_advantages(rewards: list[float], name: str = "grpo") -> list[float]:
    """Advantages of one group of rollouts (same prompt), by estimator name."""
    rewards = [float(r) for r in rewards]
    if not rewards:
        return []
    out = [float(a) for a in resolve_component("advantage", name, "orchestrator.advantage")(rewards)]
    if len(out) != len(rewards):
        raise ValueError(f"advantage {name!r} returned {len(out)} values for {len(rewards)} rewards")
    return out
