"""The environment contract: tasks in, rewards out.

The simplest environment a third party writes::

    from primerl import hookimpl
    from primerl.envs import SingleTurnEnv, Task

    class Echo(SingleTurnEnv):
        def tasks(self, split):
            for i in range(100):
                yield Task(id=str(i), prompt=f"Say {i}", answer=str(i))

        def reward(self, task, completion):
            return float(completion.strip() == task.answer)

    @hookimpl
    def register_envs(register):
        register("echo", Echo)

Every environment has a ``Config``, the class that checks its ``[env]`` section:
:class:`EnvConfig` (below) from the base class, or a subclass with the env's own options
(``--env.my_option 3``); it receives the validated instance as ``self.config``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar, Protocol, runtime_checkable

import attrs

Message = dict[str, Any]


@attrs.define(kw_only=True)
class EnvConfig:
    """The ``[env]`` section; environments subclass it to add their own options."""

    # the environment plugin (register_envs): reverse-text, alphabet-sort, wordle, swe,
    # verifiers...; `primerl plugins list` shows those installed
    name: str = "reverse-text"
    # seeds the env's own task generation (the built-in envs draw their tasks from it), apart
    # from the run's seed, so one task set can be trained with different run seeds
    seed: int = 0


def _check_prompt(_inst: Any, _attr: attrs.Attribute, value: Any) -> None:
    if isinstance(value, str):
        return
    if isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value):
        return
    raise ValueError(
        "Task.prompt must be a string or a list of chat messages like "
        "[{'role': 'user', 'content': '...'}]"
    )


@attrs.frozen(kw_only=False)
class Task:
    """One problem: a prompt, optionally a reference answer and free-form info."""

    id: str = attrs.field(validator=attrs.validators.instance_of(str))
    prompt: str | list[Message] = attrs.field(validator=_check_prompt)
    answer: str | None = None
    info: dict[str, Any] = attrs.field(factory=dict)

    def messages(self, system_prompt: str | None = None) -> list[Message]:
        """The prompt as chat messages (a string prompt becomes one user message)."""
        msgs = [{"role": "user", "content": self.prompt}] if isinstance(self.prompt, str) else list(self.prompt)
        if system_prompt and not any(m["role"] == "system" for m in msgs):
            msgs.insert(0, {"role": "system", "content": system_prompt})
        return msgs


class TaskError(RuntimeError):
    """A task that could not be run or scored: a harness failure, never a reward.

    Raise it from ``setup``, a turn, ``reward`` or ``check`` when the *environment*, not the
    model, failed: the task's interpreter or test runner is missing, its tests do not
    collect, the sandbox cannot start, its repository is unusable. Scoring such a task 0
    would train the policy on noise; instead the orchestrator drops the group, counts it
    in ``errors/task`` in metrics.jsonl and logs ``cause``, and stops the run (exit code 1,
    the cause in one line) when no task of the env can be run. ``primerl env check`` shows
    the cause next to the task.
    """

    def __init__(self, cause: str, *, task_id: str | None = None) -> None:
        super().__init__(cause)
        self.cause = cause
        self.task_id = task_id

    def __reduce__(self):  # crosses the env worker pipe intact
        return (_task_error, (self.cause, self.task_id))


def _task_error(cause: str, task_id: str | None) -> TaskError:
    return TaskError(cause, task_id=task_id)


class Environment:
    """Base of all environments. Subclasses implement ``tasks``; see SingleTurnEnv."""

    # the class that checks [env] (and a source's env table): EnvConfig, or a subclass with
    # the env's own options
    Config: ClassVar[type[EnvConfig]] = EnvConfig
    system_prompt: ClassVar[str | None] = None
    # run settings the env suggests (``{"orchestrator": {"max_tokens": 64}, "sft": {...}}``):
    # they sit below every config file and flag
    run_defaults: ClassVar[dict[str, Any]] = {}
    # merged over run_defaults when the model starts from a pretrained checkpoint
    # (model.checkpoint), whose weights want another learning rate, no warm-up on the
    # env's answers, another temperature than a random-weight preset
    pretrained_run_defaults: ClassVar[dict[str, Any]] = {}
    # how the orchestrator turns a task into a group of samples ("module:attr" of a
    # primerl.envs.rollouts.Rollout): set by SingleTurnEnv, MultiTurnEnv and AgentEnv
    rollout: ClassVar[str | None] = None

    def __init__(self, config: EnvConfig | None = None):
        self.config = config if config is not None else self.Config()

    def tasks(self, split: str) -> Iterable[Task]:
        """The tasks of a split ('train' or 'eval')."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the env holds (scratch checkouts, clients); called once when its
        process is done with it. Nothing by default."""


@runtime_checkable
class CheckableEnv(Protocol):
    """An env that can validate its own dataset: ``primerl env check NAME [--oracle] [--jobs N]``.

    ``check`` returns one row per task, ``{"instance_id": str, "reward": float | None,
    "error": str | None}``: with ``oracle`` the reward of the task's reference solution
    (a valid task scores 1), without it the reward of doing nothing (a valid task scores
    0). A task that cannot be run has ``reward`` None and ``error`` its cause (see
    :class:`TaskError`). ``workers`` tasks are checked at once.
    """

    def check(self, oracle: bool = False, workers: int = 4) -> list[dict[str, Any]]: ...


@runtime_checkable
class PreparableEnv(Protocol):
    """An env whose tasks need a one-time setup (environments, installs): ``primerl env
    prepare NAME [--jobs N]`` runs it ahead of training, with the network reachable when
    ``network`` (an RL run then reuses what it made, offline). One row per task:
    ``{"instance_id": str, "error": str | None, "setup_s": float}`` (``setup_s`` 0: already made).
    """

    def prepare(self, network: bool = True, jobs: int = 4) -> list[dict[str, Any]]: ...


class SingleTurnEnv(Environment):
    """One prompt, one completion, one reward in [0, 1]."""

    rollout: ClassVar[str | None] = "primerl.envs.rollouts:SingleTurn"

    def reward(self, task: Task, completion: str) -> float:
        raise NotImplementedError

    def score(self, task: Task, completion: str) -> float:
        """Call ``reward`` and check its range, so a buggy env fails loudly, not silently."""
        r = float(self.reward(task, completion))
        if not 0.0 <= r <= 1.0 or r != r:
            raise ValueError(f"{type(self).__name__}.reward returned {r} for task {task.id!r}; rewards must be in [0, 1]")
        return r


__all__ = ["CheckableEnv", "EnvConfig", "Environment", "Message", "PreparableEnv", "SingleTurnEnv", "Task", "TaskError"]
