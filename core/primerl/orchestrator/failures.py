"""Failed rollout groups: counted per batch, and the verdict that an env cannot run its tasks.

A group fails when its env raises :class:`primerl.envs.TaskError` (the task cannot be run:
``errors/task``) or when anything else goes wrong on the way (a crashed or timed-out env call,
an inference error: ``errors/rollout``). A failed group never trains and a fresh one takes
its place; ``orchestrator.max_failed_groups`` failures in a row with no success between them
say the env cannot run its tasks, and the orchestrator stops the run with the commonest cause
(docs/architecture.md, "Failures").
"""

from __future__ import annotations

import collections

from primerl.envs import TaskError

__all__ = ["Failures"]


class Failures:
    """Failed rollout groups: counted per batch for metrics.jsonl, and the verdict that an
    env is broken when ``limit`` groups in a row failed with nothing succeeding between."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_a_row = 0
        self.causes: collections.Counter[str] = collections.Counter()  # of the failures in a row
        self.task_errors = 0  # since the last batch: TaskError, the env's verdict on a task
        self.rollout_errors = 0  # since the last batch: anything else (a crashed env call, an HTTP error)

    def failed(self, exc: BaseException) -> str:
        """Count one failed group; returns its cause in one line."""
        if isinstance(exc, TaskError):
            self.task_errors += 1
            cause = exc.cause
        else:
            self.rollout_errors += 1
            cause = f"{type(exc).__name__}: {exc}".splitlines()[0]
        self.in_a_row += 1
        self.causes[cause] += 1
        return cause

    def succeeded(self) -> None:
        self.in_a_row = 0
        self.causes.clear()

    @property
    def hopeless(self) -> bool:
        return self.in_a_row >= self.limit

    def verdict(self) -> str:
        cause, n = self.causes.most_common(1)[0]
        return (f"the last {self.in_a_row} rollout groups failed and none succeeded in between "
                f"({n} of them: {cause})")

    def take_metrics(self) -> dict[str, int]:
        out = {"errors/task": self.task_errors, "errors/rollout": self.rollout_errors}
        self.task_errors = self.rollout_errors = 0
        return out
