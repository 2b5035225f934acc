"""Advantage estimators: a batch's groups of rewards in, one advantage per reward out.

``orchestrator.advantage`` names an estimator registered through the ``register_advantages``
hook (the core's own plugin registers the ones below) or any ``"module:attr"`` factory;
``[orchestrator.advantage_options]`` are its options (a source's own ``advantage`` and
``advantage_options`` override them). The registered target is a class: called with the
options as keywords it returns the estimator (:class:`Advantage`). The orchestrator's
advantage stage (:mod:`primerl.orchestrator.advantages`) runs it when it writes a batch,
once per source over that source's groups (a group: the episodes of one task, their rewards
shaped by :mod:`primerl.algorithms.shaping`), so a batch-level baseline (REINFORCE++) sees
the whole batch. Pure Python: no torch.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import attrs

from primerl.registry import resolve_component

__all__ = ["EPS", "GRPO", "RLOO", "Advantage", "GRPOStd", "ReinforcePP", "build_advantage", "compute_advantages"]

EPS = 1e-6


class Advantage(Protocol):
    """What ``orchestrator.advantage`` builds: ``target(**options)`` returns one."""

    def __call__(self, groups: list[list[float]]) -> list[list[float]]:
        """One advantage per reward, group by group, in the same order."""
        ...


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _std(xs: list[float]) -> float:
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))  # population (ddof = 0)


@attrs.frozen
class GRPO:
    """``grpo``: reward minus the group mean (Dr. GRPO's form: no division by the std)."""

    def __call__(self, groups: list[list[float]]) -> list[list[float]]:
        return [[r - _mean(g) for r in g] for g in groups]


@attrs.frozen
class GRPOStd:
    """``grpo_std``: (reward - group mean) / (group std + 1e-6) (DeepSeekMath's GRPO)."""

    def __call__(self, groups: list[list[float]]) -> list[list[float]]:
        return [[(r - _mean(g)) / (_std(g) + EPS) for r in g] for g in groups]


@attrs.frozen
class RLOO:
    """``rloo``: reward minus the mean of the *other* rewards of its group (leave one out),
    = G / (G - 1) x (reward - group mean); 0 in a group of one."""

    def __call__(self, groups: list[list[float]]) -> list[list[float]]:
        out = []
        for g in groups:
            n, total = len(g), sum(g)
            out.append([r - (total - r) / (n - 1) if n > 1 else 0.0 for r in g])
        return out


@attrs.frozen
class ReinforcePP:
    """``reinforce_pp``: REINFORCE++ with a group baseline: reward minus the group mean,
    then normalised by the std of those values over the whole batch (every group of the
    source in this batch), not per group: a group where every reward is alike keeps its
    zero, and rare successes in a hard group are not inflated."""

    def __call__(self, groups: list[list[float]]) -> list[list[float]]:
        centred = [[r - _mean(g) for r in g] for g in groups]
        flat = [a for g in centred for a in g]
        if not flat:
            return centred
        mean, std = _mean(flat), _std(flat)
        return [[(a - mean) / (std + EPS) for a in g] for g in centred]


def build_advantage(name: str, options: dict[str, Any] | None = None) -> Advantage:
    """The estimator ``orchestrator.advantage`` names, with its options."""
    return resolve_component("advantage", name, "orchestrator.advantage")(**dict(options or {}))


def compute_advantages(groups: list[list[float]], estimator: Advantage, name: str = "") -> list[list[float]]:
    """Advantages of a batch's groups (each a list of rewards), checked for shape."""
    groups = [[float(r) for r in g] for g in groups]
    out = estimator(groups)
    if len(out) != len(groups) or any(len(a) != len(g) for a, g in zip(out, groups)):
        raise ValueError(f"advantage {name!r} returned {[len(a) for a in out]} values for groups of "
                         f"{[len(g) for g in groups]} rewards")
    return [[float(a) for a in g] for g in out]
