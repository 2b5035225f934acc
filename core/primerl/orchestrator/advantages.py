"""The advantage stage: a source's groups of the batch in, every sample's advantage set.

Per source, once its share of the batch is in: each group's episodes (one sample each, or an
agent env's several, :func:`primerl.samples.episodes`) get their reward shaped
(:class:`primerl.algorithms.shaping.OverlongShaping`), the source's estimator
(:mod:`primerl.algorithms.advantages`) turns the groups of shaped rewards into advantages,
and each sample takes its episode's. The samples keep the env's reward; the shaping shows in
``overlong/penalty_mean``.

Pure Python: no torch.
"""

from __future__ import annotations

import attrs

from primerl.algorithms import Advantage, OverlongShaping, compute_advantages
from primerl.orchestrator.groups import Group
from primerl.samples import Sample, episodes

__all__ = ["Advantaged", "assign_advantages"]


@attrs.frozen
class Advantaged:
    """A source's samples of the batch, advantages set, and the shaping penalty of each episode."""

    samples: list[Sample]
    penalties: list[float]


def assign_advantages(groups: list[Group], estimator: Advantage, shaping: OverlongShaping, *, source: str,
                      estimator_name: str = "") -> Advantaged:
    """Set ``advantage`` (and ``source``) on every sample of ``groups``, one source's groups
    of the batch, in order; ``estimator_name`` names the estimator in a shape error."""
    by_group = [episodes(g.samples) for g in groups]  # per group: episode -> (reward, its samples)
    penalties = [[shaping(samples) for _, samples in e.values()] for e in by_group]
    shaped = [[reward + p for (reward, _), p in zip(e.values(), ps, strict=True)]
              for e, ps in zip(by_group, penalties, strict=True)]
    advantages = compute_advantages(shaped, estimator, estimator_name)
    out: list[Sample] = []
    for g, e, adv in zip(groups, by_group, advantages, strict=True):
        by_episode = dict(zip(e, adv, strict=True))
        for i, s in enumerate(g.samples):
            s.advantage = by_episode[s.episode if s.episode is not None else i]
            s.source = source
            out.append(s)
    return Advantaged(samples=out, penalties=[p for ps in penalties for p in ps])
