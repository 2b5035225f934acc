"""A rollout group: the samples of one task, from the moment it starts to its batch.

The group starter makes one per drawn task; the source's rollout kind
(:class:`primerl.envs.rollouts.Rollout`, e.g. ``SingleTurn.run``) fills its ``samples``;
once finished it waits in its source's queue until the batch writer takes it through the
filters (:mod:`.filters`) and the advantage stage (:mod:`.advantages`) into a batch. It is
:class:`primerl.envs.rollouts.GroupLike` plus what the orchestrator keeps about it.
"""

from __future__ import annotations

import itertools

import attrs

from primerl.envs import Task
from primerl.samples import Sample

__all__ = ["Group"]

_GROUP_IDS = itertools.count()


@attrs.define
class Group:
    """The samples of one task, and the version of the policy when they were started."""

    task: Task
    start_version: int
    size: int  # samples (episodes) to draw
    temperature: float
    samples: list[Sample] = attrs.Factory(list)
    tokens: int = 0
    cancelled: bool = False
    env_metrics: list[dict[str, float]] = attrs.Factory(list)  # an agent env's, one dict per episode
    session: str = attrs.Factory(lambda: f"group-{next(_GROUP_IDS)}")  # keeps the group on one server
    draw: int | None = None  # its task's number in the run's draws (None: not drawn, e.g. evaluation)
    source: str = ""  # the source it trains for (orchestrator.sources; the [env]'s name alone)

    @property
    def oldest_version(self) -> int:
        """The oldest policy version among its sampled tokens (its start version if none)."""
        versions = [v for s in self.samples if (v := s.oldest_version) is not None]
        return min(versions, default=self.start_version)
