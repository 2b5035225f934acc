"""The environments a run trains on (``orchestrator.sources``, or ``[env]`` alone), each
with its own task draws, rollout kind, advantage estimator and share of every batch.

A source draws its tasks, numbered, from its env's train split reshuffled each epoch by its
own seed (:meth:`Source.draws`); the group starter turns each draw into a
:class:`~primerl.orchestrator.groups.Group` that the source's rollout kind fills; finished
groups wait in :attr:`Source.finished` until the batch writer takes its ``quota`` of them.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import Iterator
from typing import Any

import attrs

from primerl.algorithms import Advantage
from primerl.config import SourceConfig
from primerl.envs import Environment, Task
from primerl.envs.rollouts import Rollout
from primerl.envs.workers import EnvWorkers
from primerl.orchestrator import log
from primerl.orchestrator.groups import Group
from primerl.orchestrator.positions import SourcePosition

__all__ = ["Source"]


@attrs.define(eq=False)
class Source:
    """One environment the run trains on: its env, rollout kind and workers, its own task
    draws and their position, and its share of every batch (``quota`` groups of
    ``group_size``)."""

    cfg: SourceConfig
    env: Environment
    kind: Rollout  # its rollout kind (primerl.envs.rollouts), built over its own RolloutContext
    workers: EnvWorkers | None
    quota: int  # groups in every batch
    seed: Any  # shuffles its train split, each epoch
    advantage: Advantage  # its estimator (orchestrator.advantage, or its own)
    finished: asyncio.Queue[Group] = attrs.Factory(asyncio.Queue)  # its finished groups, not in a batch yet
    batching: list[Group] = attrs.Factory(list)  # its groups of the batch being filled
    pending: dict[int, Task] = attrs.Factory(dict)  # drawn tasks in no batch yet, by draw
    drawn: int = 0
    tasks: Iterator[tuple[int, Task]] | None = None

    @property
    def name(self) -> str:
        return self.cfg.name

    def draws(self) -> Iterator[tuple[int, Task]]:
        """Every task it draws, numbered: its train split, reshuffled each epoch."""
        rng = random.Random(self.seed)
        tasks = list(self.env.tasks("train"))
        if not tasks:
            raise ValueError(f"environment '{self.cfg.env.name}' has no train tasks")
        for i in itertools.count():
            if i % len(tasks) == 0:
                rng.shuffle(tasks)
            yield i, tasks[i % len(tasks)]

    def task_stream(self, position: SourcePosition | None) -> Iterator[tuple[int, Task]]:
        """The draws from ``position`` on: its unbatched tasks first, then the draws after it."""
        draws = self.draws()
        if position is not None:
            wanted = dict(position.pending)
            restored = [(i, task) for i, task in itertools.islice(draws, position.drawn) if i in wanted]
            if [(i, task.id) for i, task in restored] != list(position.pending):
                log(f"warning: the train tasks of source {self.name!r} are not those of the run being resumed (the "
                    f"recorded draws name other tasks): the task order cannot continue exactly")
            yield from restored
        yield from draws

    def resume_at(self, position: SourcePosition | None) -> None:
        """Continue the draws from ``position`` (None: from the start)."""
        self.drawn = position.drawn if position is not None else 0
        self.tasks = self.task_stream(position)

    def draw(self) -> tuple[int, Task]:
        """The next task to start, numbered; it stays pending until it is in a batch (or
        its group is dropped, cancelled or failed)."""
        assert self.tasks is not None, "resume_at() sets the draws"
        draw, task = next(self.tasks)
        if not isinstance(task, Task):
            raise TypeError(f"environment '{self.cfg.env.name}' yielded a {type(task).__name__} from its "
                            "train split, not a primerl.envs.Task")
        self.pending[draw] = task
        self.drawn = max(self.drawn, draw + 1)
        return draw, task

    def position(self) -> SourcePosition:
        """Where its draws stand now: how many were drawn, and which are in no batch yet."""
        return SourcePosition(drawn=self.drawn, pending=tuple((i, t.id) for i, t in sorted(self.pending.items())))
