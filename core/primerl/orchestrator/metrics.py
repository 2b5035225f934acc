"""A batch's figures: what the orchestrator logs with every batch (the trainer writes them
into ``metrics.jsonl`` with its own step's).

:func:`batch_metrics` composes them in a fixed order: the step, rewards, staleness, what the
other stages counted (filters, shaping, failed groups, the inference client), the policy
served, token counts and lengths, then each source's figures (runs of several), turns
(multi-turn envs) and an agent env's own metrics (``env/<key>``, per episode). Evaluations
that ended since the last batch are added by the orchestrator.

Pure Python: no torch.
"""

from __future__ import annotations

from collections.abc import Mapping

from primerl.algorithms import OverlongShaping
from primerl.orchestrator.filters import staleness
from primerl.orchestrator.groups import Group
from primerl.samples import Sample

__all__ = ["batch_metrics", "shaping_metrics"]


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def shaping_metrics(shaping: OverlongShaping, penalties: list[float]) -> dict[str, float]:
    """``overlong/penalty_mean``: the mean shaping penalty per episode, when shaping is on."""
    return {"overlong/penalty_mean": _mean(penalties)} if shaping.enabled else {}


def _rewards(samples: list[Sample]) -> dict[str, float]:
    rewards = [s.reward for s in samples]
    return {"reward/mean": _mean(rewards), "reward/max": max(rewards), "reward/min": min(rewards)}


def _staleness(step: int, groups: list[Group]) -> dict[str, float]:
    behind = [staleness(g, step) for g in groups]
    return {"off_policy/max": max(behind), "off_policy/mean": _mean(behind)}


def _per_source(batch: Mapping[str, list[Group]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, groups in batch.items():
        mine = [s.reward for g in groups for s in g.samples]
        out[f"reward/{name}/mean"] = _mean(mine)
        out[f"samples/{name}"] = len(mine)
    return out


def _turns(samples: list[Sample]) -> dict[str, float]:
    turns = [s.turns for s in samples if s.turns is not None]
    return {"turns/mean": _mean(turns)} if turns else {}


def _env(groups: list[Group]) -> dict[str, float]:
    """An agent env's own metrics, each the mean over the episodes that report it."""
    per_episode = [m for g in groups for m in g.env_metrics]
    return {f"env/{key}": _mean([m[key] for m in per_episode if key in m])
            for key in sorted({k for m in per_episode for k in m})}


def batch_metrics(step: int, batch: Mapping[str, list[Group]], samples: list[Sample], *,
                  counts: Mapping[str, float], policy_version: int, seconds: float) -> dict[str, float]:
    """Batch ``step``'s figures. ``batch``: each source's groups, in source order; ``samples``:
    all of them, in the batch's order; ``counts``: what the other stages counted since the
    last batch (filters, shaping, failures, the inference client), in that order;
    ``policy_version``: the version inference serves; ``seconds``: since the last batch."""
    groups = [g for gs in batch.values() for g in gs]
    return {
        "step": step,
        **_rewards(samples),
        **_staleness(step, groups),
        **counts,
        "inference/policy_version": policy_version,
        "batch/sampled_tokens": sum(s.sampled_tokens for s in samples),
        "orchestrator/batch_seconds": seconds,
        "seq_len/mean": sum(len(s.tokens) for s in samples) / len(samples),
        "completion_len/mean": sum(s.sampled_tokens for s in samples) / len(samples),
        **(_per_source(batch) if len(batch) > 1 else {}),
        **_turns(samples),
        **_env(groups),
    }
