"""Scoring a policy on an environment's tasks: ``primerl eval`` and a run's ``eval/...`` metrics.

Both go through :func:`score_tasks`: every task is run ``samples`` times at one temperature by
the env's own rollout kind (single-turn, multi-turn or agent, exactly as training runs it),
each episode's reward is kept per task, and :func:`summarize` turns the scores into the mean
reward (over every episode), its standard error over tasks, and pass@k for each k up to
``samples``: the unbiased estimator of Chen et al. (2021), ``1 - C(n - c, k) / C(n, k)`` per
task with ``c`` of its ``n`` episodes at or above ``pass_threshold``, averaged over tasks. A
task that could not be run (an env error, an inference error) is counted in ``errors`` and
left out of every mean.

The run's orchestrator scores ``orchestrator.eval_tasks`` eval tasks every ``eval_every``
batches (``orchestrator.eval_samples`` each) and logs :func:`run_metrics` of the summary;
``primerl eval`` scores a model, a checkpoint, a GGUF file or a run's checkpoint on the same
code, printing one JSON line per task and the summary.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Sequence
from typing import Any

import attrs

from primerl.samples import Sample, episodes

_SESSIONS = itertools.count()


@attrs.define
class EvalGroup:
    """A task's episodes as a rollout kind fills them (:class:`primerl.envs.rollouts.GroupLike`)."""

    task: Any
    size: int
    temperature: float
    samples: list[Sample] = attrs.Factory(list)
    tokens: int = 0
    env_metrics: list[dict[str, float]] = attrs.Factory(list)
    session: str = attrs.Factory(lambda: f"eval-{next(_SESSIONS)}")


@attrs.frozen
class TaskScore:
    """One task's outcome: the reward of each of its episodes, and the samples they made."""

    task_id: str
    rewards: tuple[float, ...]
    samples: tuple[Sample, ...] = ()
    error: str | None = None  # the task could not be run: its cause in one line

    def passed(self, threshold: float) -> int:
        return sum(r >= threshold for r in self.rewards)

    def record(self, threshold: float) -> dict[str, Any]:
        """The JSON line ``primerl eval`` prints for the task."""
        if self.error is not None:
            return {"task_id": self.task_id, "error": self.error}
        return {"task_id": self.task_id, "mean_reward": sum(self.rewards) / len(self.rewards),
                "rewards": list(self.rewards), "passed": self.passed(threshold)}


async def score_tasks(kind: Any, tasks: Sequence[Any], *, samples: int, temperature: float,
                      concurrency: int = 0) -> list[TaskScore]:
    """Run every task ``samples`` times with the rollout ``kind``; one score per task, in order.
    ``concurrency``: tasks in flight at once (0: all of them; the servers queue requests)."""
    gate = asyncio.Semaphore(concurrency) if concurrency > 0 else None

    async def one(task: Any) -> TaskScore:
        group = EvalGroup(task=task, size=samples, temperature=temperature)
        try:
            if gate is None:
                await kind.run(group)
            else:
                async with gate:
                    await kind.run(group)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a failed task is a row, the others go on
            cause = " ".join(f"{type(exc).__name__}: {exc}".split())
            return TaskScore(task_id=task.id, rewards=(), error=cause)
        rewards = tuple(float(reward) for reward, _ in episodes(group.samples).values())
        if not rewards:
            return TaskScore(task_id=task.id, rewards=(), error="no episode ended")
        return TaskScore(task_id=task.id, rewards=rewards, samples=tuple(group.samples))

    return list(await asyncio.gather(*(one(t) for t in tasks)))


def pass_at_k(n: int, c: int, k: int) -> float:
    """The chance that at least one of k episodes drawn without replacement from n, c of
    them passing, passes (Chen et al. 2021's unbiased estimator)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def ks_for(samples: int) -> list[int]:
    """The k of pass@k reported for ``samples`` episodes per task: 1, then powers of two, and
    ``samples`` itself."""
    ks = [1]
    while ks[-1] * 2 < samples:
        ks.append(ks[-1] * 2)
    if samples > 1:
        ks.append(samples)
    return ks


def summarize(scores: Sequence[TaskScore], *, pass_threshold: float = 1.0) -> dict[str, Any]:
    """The figures of an evaluation: ``mean_reward`` (over every episode of the tasks that
    ran), ``reward_stderr`` (of the per-task means), ``pass@k``, ``n`` (tasks scored),
    ``samples`` (episodes per task), ``errors`` (tasks that could not be run)."""
    ran = [s for s in scores if s.error is None]
    out: dict[str, Any] = {"n": len(ran), "errors": len(scores) - len(ran)}
    if not ran:
        return {**out, "mean_reward": None}
    per_episode = [r for s in ran for r in s.rewards]
    means = [sum(s.rewards) / len(s.rewards) for s in ran]
    n_samples = min(len(s.rewards) for s in ran)
    spread = math.sqrt(sum((m - sum(means) / len(means)) ** 2 for m in means) / (len(means) - 1)) if len(means) > 1 else 0.0
    out.update(mean_reward=sum(per_episode) / len(per_episode), reward_stderr=spread / math.sqrt(len(means)),
               samples=n_samples, pass_threshold=pass_threshold)
    for k in ks_for(n_samples):
        out[f"pass@{k}"] = sum(pass_at_k(len(s.rewards), s.passed(pass_threshold), k) for s in ran) / len(ran)
    return out


def run_metrics(summary: dict[str, Any], prefix: str) -> dict[str, Any]:
    """A summary as a run's metrics: ``<prefix>/reward/mean``, ``<prefix>/pass@k``,
    ``<prefix>/tasks`` and ``<prefix>/errors``."""
    out: dict[str, Any] = {f"{prefix}/tasks": summary["n"], f"{prefix}/errors": summary["errors"]}
    if summary.get("mean_reward") is not None:
        out[f"{prefix}/reward/mean"] = summary["mean_reward"]
        out.update({f"{prefix}/{k}": v for k, v in summary.items() if k.startswith("pass@")})
    return out
