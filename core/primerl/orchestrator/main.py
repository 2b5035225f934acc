"""The orchestrator process: rollouts in, training batches out, weights kept fresh.

It is an asyncio program with three concurrent jobs:

* **weight watcher** — as soon as the trainer publishes ``weights/step_n`` (its
  ``STABLE`` file appears), tell every inference server to load it. In-flight requests
  carry on; later tokens record version n.
* **group starter** — keep rollout groups in flight (one chat request with
  ``n = group_size`` per task, so the prompt is prefilled once), bounded by
  ``max_concurrent`` samples and by ``async_level``: with inference at version v, the
  groups of batches up to v + 1 + async_level may have been started. ``async_level = 0``
  is synchronous: batch n is generated entirely by v(n-1).
* **batch writer** — fill batch n with the first groups to finish (a long-tail rollout
  never holds a batch back), drop samples whose oldest token version is more than
  ``max_off_policy_steps`` behind n - 1, cancel in-flight groups that can no longer
  qualify, compute group advantages and write ``rollouts/step_n.pt`` atomically.

Two more run beside them when asked: every ``eval_every`` batches an **evaluation** of
the env's eval split, logged with the next batch; and failed groups are counted
(``errors/task``, ``errors/rollout``) until ``max_failed_groups`` in a row say the env
cannot run its tasks, which stops the run with the cause.

The data position: tasks are drawn, numbered, from the env's train split reshuffled each
epoch by ``random.Random(seed)``. Just before ``rollouts/step_n.pt`` the orchestrator
writes ``rollouts/step_n.state.json``: how many tasks it has drawn and which drawn ones are
in no batch yet (in flight, or finished and waiting); the trainer copies it into
``checkpoints/step_n``. Started again, the orchestrator takes the checkpoint the trainer
takes (``primerl.resume.usable_checkpoint``), replays the draws up to that position, starts
the unbatched tasks first and writes batches s+1..: the same task order as a run that was
never stopped.

Requests reach the inference servers (``inference.replicas`` of them) through the router
plugin (``inference.router``) and :class:`~primerl.orchestrator.client.InferenceClient`,
which ejects a dead server, re-sends its requests to another and readmits it with the
current weights (``inference/resent``, ``inference/servers_up`` in each batch's metrics);
samples leave as :class:`~primerl.samples.Sample` records, paths come from
:class:`~primerl.rundir.RunDir`.

A group's samples come from the env's rollout kind (:mod:`primerl.envs.rollouts`, named by
``env.rollout``): single-turn (one chat request with ``n``, the env scores each completion),
multi-turn (token-exact episodes, the env's turns computed in its worker processes), or
agent (the env runs the whole group in a worker against an inference endpoint; the verifiers
bridge, agent harnesses). How many groups are started is derived from where they are
(:attr:`Orchestrator.started`), never counted up and down by hand.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import itertools
import json
import random
import signal
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs

from primerl import watchdog
from primerl.advantages import Advantage, build_advantage, compute_advantages
from primerl.config import EnvConfig, EvalSourceConfig, RunConfig, SourceConfig
from primerl.envs import Environment, Task, TaskError
from primerl.envs.rollouts import rollout_kind
from primerl.envs.workers import EnvWorkers
from primerl.errors import PrimerlError
from primerl.evaluation import run_metrics, score_tasks, summarize
from primerl.inference import inference_urls
from primerl.orchestrator.client import Client, inference_client
from primerl.registry import get_registry
from primerl.resume import usable_checkpoint
from primerl.rundir import ORCHESTRATOR_STATE, RunDir, step_name, write_atomically
from primerl.samples import RolloutBatch, Sample, episodes, write_batch

POSITION_FORMAT = "primerl.orchestrator_state"  # rollouts/step_n.state.json, checkpoints/step_n/orchestrator_state.json
POSITION_VERSION = 2  # 2: a position per source; 1 (read too): the one source's at the top level


def log(msg: str) -> None:
    print(f"[orchestrator {time.strftime('%H:%M:%S')}] {msg}", flush=True)


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
        versions = [v for s in self.samples if (v := s.oldest_version) is not None]
        return min(versions, default=self.start_version)


_GROUP_IDS = itertools.count()


class RunFailed(Exception):
    """The run cannot go on: the env cannot run its tasks. The message names the cause."""


@attrs.frozen
class SourcePosition:
    """Where one source's task draws stood."""

    drawn: int  # tasks drawn so far
    pending: tuple[tuple[int, str], ...] = ()  # (draw, task id) of drawn tasks in no batch yet


@attrs.frozen
class DataPosition:
    """Where every source's task draws stood once batch ``step`` was written."""

    step: int
    sources: dict[str, SourcePosition]

    def record(self, batch: dict[str, list[int]]) -> dict[str, Any]:
        """The JSON object written next to the batch (``batch``: each source's groups' draws)."""
        return {"format": POSITION_FORMAT, "version": POSITION_VERSION, "step": self.step,
                "sources": {name: {"drawn": p.drawn, "pending": [list(x) for x in p.pending]}
                            for name, p in self.sources.items()},
                "batch": batch}

    @classmethod
    def read(cls, path: Any, first: str) -> DataPosition:
        """``first``: the run's first source, whose position a version 1 file holds."""
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict) or data.get("format") != POSITION_FORMAT or data.get("version", 0) > 2:
            raise ValueError(f"{path} is not an orchestrator state of format version {POSITION_VERSION} or older")
        listed = data.get("sources", {first: data})
        return cls(step=int(data["step"]), sources={
            name: SourcePosition(drawn=int(p["drawn"]), pending=tuple((int(i), str(t)) for i, t in p["pending"]))
            for name, p in listed.items()})


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


SKIP_UNIFORM_MAX = 4  # orchestrator.skip_uniform_groups skips at most this many batches' worth of groups per batch


def uniform(group: Group) -> bool:
    """Every episode of the group has the same reward: a group-relative advantage is 0 for all."""
    return len({s.reward for s in group.samples}) <= 1


def overlong_penalty(samples: list[Sample], o: Any) -> float:
    """DAPO's soft overlong punishment of an episode (0 unless ``orchestrator.overlong_buffer``):
    with L = max_tokens and B the buffer, a model turn of n tokens (the episode's mean) costs
    0 up to L - B, (L - B - n) / B x overlong_penalty inside the buffer, -overlong_penalty at L."""
    if not o.overlong_buffer:
        return 0.0
    turns = sum(s.turns or 1 for s in samples)
    n = sum(s.sampled_tokens for s in samples) / max(turns, 1)
    start = o.max_tokens - o.overlong_buffer
    if n <= start:
        return 0.0
    return -o.overlong_penalty * min((n - start) / o.overlong_buffer, 1.0)


@attrs.define(eq=False)
class Source:
    """One environment the run trains on (``orchestrator.sources``, or ``[env]`` alone): its
    env, rollout kind and workers, its own task draws and their position, and its share of
    every batch (``quota`` groups of ``group_size``)."""

    cfg: SourceConfig
    env: Environment
    kind: Any  # its rollout kind (primerl.envs.rollouts), built over its own RolloutContext
    workers: EnvWorkers | None
    quota: int  # groups in every batch
    seed: Any  # shuffles its train split, each epoch
    advantage: Advantage  # its estimator (orchestrator.advantage, or its own)
    finished: asyncio.Queue = attrs.Factory(asyncio.Queue)  # its finished groups, not in a batch yet
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


class Orchestrator:
    def __init__(self, cfg: RunConfig, env: Environment, client: Client):
        self.cfg = cfg
        self.o = cfg.orchestrator
        self.client = client
        self.run_dir = RunDir(cfg.output_dir)
        self.version = -1  # newest version loaded into inference (-1: none yet)
        self.in_flight: dict[asyncio.Task, Group] = {}
        self.version_changed = asyncio.Event()
        self.failures = Failures(self.o.max_failed_groups)
        self.broken: asyncio.Future[str] | None = None  # set with the cause when the env cannot run its tasks
        # rewards may call slow verifiers; one thread per in-flight sample keeps them overlapped
        self.scorer = ThreadPoolExecutor(max_workers=max(self.o.max_concurrent, self.o.group_size),
                                         thread_name_prefix="score")
        # the engine's routed experts travel with each sample for R3 and the routing metrics
        self.want_routed = cfg.trainer.router_replay or cfg.trainer.routing_metrics
        self.closing = False
        self.tokenizer: Any = None
        listed = self.o.train_sources(cfg.env)
        quotas = self.o.groups_per_batch(cfg.env)
        self.sources: list[Source] = []
        for i, sc in enumerate(listed):
            env_i = env if i == 0 else get_registry().load("env", sc.env.name)(sc.env)
            kind, workers = self._rollout_kind(env_i, sc.env)
            seed = cfg.seed if len(listed) == 1 else f"{cfg.seed}/{sc.name}"
            self.sources.append(Source(cfg=sc, env=env_i, kind=kind, workers=workers, quota=quotas[sc.name],
                                       seed=seed, advantage=build_advantage(sc.advantage, sc.advantage_options)))
        self.by_name = {src.name: src for src in self.sources}
        self.groups_per_batch = sum(src.quota for src in self.sources)
        self.eval_sources: list[tuple[EvalSourceConfig, Environment, Any, EnvWorkers | None]] = []
        for ec in self.o.eval_sources:
            env_e = get_registry().load("env", ec.env.name)(ec.env)
            self.eval_sources.append((ec, env_e, *self._rollout_kind(env_e, ec.env)))
        # resuming: the trainer continues from the same checkpoint (the same choice, made alike)
        found = usable_checkpoint(self.run_dir, log=log)
        self.resume_step = found[0] if found is not None else 0
        position = self._read_position(self.resume_step) if found is not None else None
        for src in self.sources:
            at = position.sources.get(src.name) if position is not None else None
            if position is not None and at is None:
                log(f"source {src.name!r} has no data position in the checkpoint (added since): its draws start over")
            src.drawn = at.drawn if at is not None else 0
            src.tasks = src.task_stream(at)
        self.batches_written = self.resume_step  # batches before a resume included
        self.eval_tasks: list[Task] = []  # the eval split's first eval_tasks tasks, read at start when eval_every
        self.eval_results: list[dict[str, float]] = []  # finished evaluations, logged with the next batch
        self.evaluations: set[asyncio.Task] = set()

    def _rollout_kind(self, env: Environment, env_cfg: EnvConfig) -> tuple[Any, EnvWorkers | None]:
        """An env's rollout kind, over its own context, and its worker processes if it runs in them."""
        kind, workers = rollout_kind(self.cfg, env, env_cfg, self.client, tokenizer=self._tokenizer,
                                     scorer=self.scorer, want_routed=self.want_routed, closing=lambda: self.closing)
        if workers is not None:
            watchdog.add_children_source(workers.pids)
        return kind, workers

    def _tokenizer(self) -> Any:
        if self.tokenizer is None:
            self.tokenizer = get_registry().load("model", self.cfg.model.name)().tokenizer(self.cfg.model)
        return self.tokenizer

    def workers(self) -> list[EnvWorkers]:
        return [w for w in [*(s.workers for s in self.sources), *(e[3] for e in self.eval_sources)] if w is not None]

    def started_of(self, src: Source) -> int:
        """Groups of ``src`` that count toward the batches generation may run ahead to: those
        of written batches (a resume's included), of the batch being filled, finished ones
        waiting, and those in flight. A group dropped as stale, cancelled or failed no longer
        counts: a fresh group takes its place."""
        in_flight = sum(1 for g in self.in_flight.values() if not g.cancelled and g.source == src.name)
        return self.batches_written * src.quota + len(src.batching) + src.finished.qsize() + in_flight

    @property
    def started(self) -> int:
        return sum(self.started_of(src) for src in self.sources)

    def _read_position(self, step: int) -> DataPosition:
        """Batch ``step``'s data position: from its checkpoint, else from beside the batch, else
        (a checkpoint of an older primerl) estimated as if no group had failed or been dropped."""
        for path in (self.run_dir.checkpoint(step) / ORCHESTRATOR_STATE, self.run_dir.batch_state(step)):
            if path.is_file():
                try:
                    position = DataPosition.read(path, first=self.sources[0].name)
                except (ValueError, KeyError, TypeError) as exc:
                    log(f"warning: {path} is unreadable ({exc})")
                    continue
                said = ", ".join(f"{name}: {p.drawn} tasks drawn, {len(p.pending)} of them in no batch yet"
                                 for name, p in position.sources.items())
                log(f"resuming after batch {step} ({path}): {said}; those started again first")
                return position
        log(f"resuming after batch {step}: checkpoints/{step_name(step)} has no data position (an older primerl); "
            f"the task order continues from where it stands when no group failed or was dropped")
        return DataPosition(step=step, sources={src.name: SourcePosition(drawn=step * src.quota)
                                                for src in self.sources})

    def _eval_tasks(self) -> list[Task]:
        tasks = list(itertools.islice(self.sources[0].env.tasks("eval"), self.o.eval_tasks))
        if not tasks:
            raise RunFailed(f"environment '{self.cfg.env.name}' has no eval tasks: set orchestrator.eval_every 0")
        return tasks

    async def evaluate(self, after_batch: int, kind: Any = None, tasks: list[Task] | None = None,
                       prefix: str = "eval") -> None:
        """Each eval task ``orchestrator.eval_samples`` times at ``eval_temperature``, with the
        policy inference serves now (the first source's env and its eval tasks, or an eval
        source's: ``kind``, ``tasks``, logged under ``prefix``), scored by
        :mod:`primerl.evaluation` as ``primerl eval`` scores them.

        Runs beside training (its requests share the servers with rollouts); its figures
        are logged as ``<prefix>/reward/mean``, ``<prefix>/pass@k``... with the first batch
        written after it ends, together with the policy version it measured."""
        kind = kind or self.sources[0].kind
        tasks = self.eval_tasks if tasks is None else tasks
        version, t0 = self.version, time.monotonic()
        scores = await score_tasks(kind, tasks, samples=self.o.eval_samples, temperature=self.o.eval_temperature)
        for failed in [s for s in scores if s.error is not None][:3]:
            log(f"evaluation ({prefix}) after batch {after_batch}: task {failed.task_id} failed: {failed.error}")
        summary = summarize(scores)
        result = {f"{prefix}/policy_version": version, **run_metrics(summary, prefix),
                  f"{prefix}/seconds": time.monotonic() - t0}
        self.eval_results.append(result)
        log(f"evaluation ({prefix}) of v{version} on {summary['n']} eval tasks: "
            + (f"reward {summary['mean_reward']:.3f}" if summary["n"] else "no task finished"))

    def _start_evaluation(self, after_batch: int, *args: Any) -> None:
        job = asyncio.create_task(self.evaluate(after_batch, *args))
        self.evaluations.add(job)
        job.add_done_callback(self.evaluations.discard)

    def _start_due_evaluations(self, n: int) -> None:
        """The evaluations due after batch ``n`` (none after the last: the run ends there)."""
        if n >= self.cfg.max_steps:
            return
        if self.o.eval_every and n % self.o.eval_every == 0:
            self._start_evaluation(n)
        for ec, env, kind, _ in self.eval_sources:
            if n % ec.every == 0:
                tasks = list(itertools.islice(env.tasks(ec.split), ec.tasks))
                if not tasks:
                    raise RunFailed(f"eval source {ec.name!r} (env '{ec.env.name}') has no {ec.split!r} tasks: set "
                                    f"its split to one the env has")
                self._start_evaluation(n, kind, tasks, f"eval/{ec.name}")

    async def watch_weights(self) -> None:
        while True:
            newest = self.run_dir.newest_published()
            if newest is not None and newest > self.version:
                with watchdog.waiting("weights", f"inference loading policy v{newest} (from v{self.version})"):
                    await self.client.load_weights(self.run_dir.weights_source(newest), newest)
                self.version = newest
                self.version_changed.set()
                up, total = len(self.client.servers_up()), len(self.client.servers)
                log(f"inference now serves policy v{newest}" + (f" ({up} of {total} servers up)" if up < total else ""))
            await asyncio.sleep(0.05)

    # ---- rollouts -------------------------------------------------------------------------
    def may_start(self, src: Source | None = None) -> bool:
        """Whether a group of ``src`` (the first source by default) may start now."""
        src = src or self.sources[0]
        allowed_batches = self.version + 1 + self.o.async_level
        samples_in_flight = sum(g.size for g in self.in_flight.values())
        size = src.cfg.group_size
        return (self.version >= self.resume_step and self.started_of(src) < allowed_batches * src.quota
                and samples_in_flight + size <= max(self.o.max_concurrent, size))

    async def start_groups(self) -> None:
        while True:
            started = True
            while started:  # one group of each source in turn, while any may start
                started = False
                for src in self.sources:
                    if not self.may_start(src):
                        continue
                    draw, task = next(src.tasks)
                    if not isinstance(task, Task):
                        raise TypeError(f"environment '{src.cfg.env.name}' yielded a {type(task).__name__} from its "
                                        "train split, not a primerl.envs.Task")
                    src.pending[draw] = task
                    src.drawn = max(src.drawn, draw + 1)
                    group = Group(task=task, start_version=self.version, size=src.cfg.group_size,
                                  temperature=self.o.temperature, draw=draw, source=src.name)
                    job = asyncio.create_task(self.rollout(group, src.kind))
                    self.in_flight[job] = group
                    job.add_done_callback(self._on_done)
                    started = True
            self.version_changed.clear()
            try:
                await asyncio.wait_for(self.version_changed.wait(), timeout=0.05)
            except asyncio.TimeoutError:
                pass

    def _on_done(self, job: asyncio.Task) -> None:
        group = self.in_flight.pop(job)
        src = self.by_name[group.source]
        if job.cancelled():
            src.pending.pop(group.draw, None)
            return
        exc = job.exception()
        watchdog.advance()  # a group ended (a failed one too: the run is not stuck)
        if exc is None:
            self.failures.succeeded()
            src.finished.put_nowait(group)
            return
        src.pending.pop(group.draw, None)  # a fresh group takes its place
        if isinstance(exc, PrimerlError):  # the user's setup is wrong: no other group will fare better
            if self.broken is not None and not self.broken.done():
                self.broken.set_result(str(exc))
            return
        cause = self.failures.failed(exc)
        if self.failures.causes[cause] <= 3 or self.failures.in_a_row % 50 == 0:  # not one line per failure
            log(f"rollout of task {group.task.id} failed: {cause}; starting another")
        if self.failures.hopeless and self.broken is not None and not self.broken.done():
            self.broken.set_result(self.failures.verdict())

    async def rollout(self, group: Group, kind: Any) -> None:
        """Fill ``group.samples`` with ``kind`` (its source's rollout kind)."""
        await kind.run(group)

    # ---- batches --------------------------------------------------------------------------
    async def write_batches(self) -> None:
        last = time.monotonic()
        for n in range(self.resume_step + 1, self.cfg.max_steps + 1):
            dropped = skipped = 0
            for src in self.sources:  # each its quota of groups, the first of them to finish
                while len(src.batching) < src.quota:
                    watchdog.doing(f"filling batch {n}: {len(src.batching)} of {src.quota} groups of {src.name}")
                    group = await src.finished.get()
                    staleness = (n - 1) - group.oldest_version
                    src.pending.pop(group.draw, None)
                    if staleness > self.o.max_off_policy_steps:
                        dropped += len(group.samples)  # a fresh group takes its place
                        continue
                    if self.o.skip_uniform_groups and uniform(group) and skipped < SKIP_UNIFORM_MAX * self.groups_per_batch:
                        skipped += 1  # DAPO's dynamic sampling: no signal in it; a fresh group takes its place
                        continue
                    src.batching.append(group)
            groups = [g for src in self.sources for g in src.batching]
            self.cancel_hopeless(n + 1)
            position = DataPosition(step=n, sources={
                src.name: SourcePosition(drawn=src.drawn,
                                         pending=tuple((i, t.id) for i, t in sorted(src.pending.items())))
                for src in self.sources})
            samples: list[Sample] = []
            penalties: list[float] = []
            for src in self.sources:  # its estimator over its groups of the batch, one advantage per episode
                by_group = [episodes(g.samples) for g in src.batching]  # (an agent env's episode may be several samples)
                shaped = [[reward + overlong_penalty(ep, self.o) for reward, ep in e.values()] for e in by_group]
                penalties += [overlong_penalty(ep, self.o) for e in by_group for _, ep in e.values()]
                advantages = compute_advantages(shaped, src.advantage, src.cfg.advantage)
                for g, e, adv in zip(src.batching, by_group, advantages, strict=True):
                    by_episode = dict(zip(e, adv, strict=True))
                    for i, s in enumerate(g.samples):
                        s.advantage = by_episode[s.episode if s.episode is not None else i]
                        s.source = src.name
                        samples.append(s)
            now = time.monotonic()
            rewards = [s.reward for s in samples]
            staleness = [(n - 1) - g.oldest_version for g in groups]
            metrics = {
                "step": n,
                "reward/mean": sum(rewards) / len(rewards),
                "reward/max": max(rewards),
                "reward/min": min(rewards),
                "off_policy/max": max(staleness),
                "off_policy/mean": sum(staleness) / len(staleness),
                "dropped_stale": dropped,
                **({"skipped_uniform": skipped} if self.o.skip_uniform_groups else {}),
                **({"overlong/penalty_mean": sum(penalties) / len(penalties)} if self.o.overlong_buffer else {}),
                **self.failures.take_metrics(),
                **self.client.take_metrics(),
                "inference/policy_version": self.version,
                "batch/sampled_tokens": sum(s.sampled_tokens for s in samples),
                "orchestrator/batch_seconds": now - last,
                "seq_len/mean": sum(len(s.tokens) for s in samples) / len(samples),
                "completion_len/mean": sum(s.sampled_tokens for s in samples) / len(samples),
            }
            if len(self.sources) > 1:  # each source's own figures
                for src in self.sources:
                    mine = [s.reward for g in src.batching for s in g.samples]
                    metrics[f"reward/{src.name}/mean"] = sum(mine) / len(mine)
                    metrics[f"samples/{src.name}"] = len(mine)
            turns = [s.turns for s in samples if s.turns is not None]
            if turns:
                metrics["turns/mean"] = sum(turns) / len(turns)
            env_metrics = [m for g in groups for m in g.env_metrics]
            for key in sorted({k for m in env_metrics for k in m}):  # an agent env's own metrics, per episode
                values = [m[key] for m in env_metrics if key in m]
                metrics[f"env/{key}"] = sum(values) / len(values)
            for result in self.eval_results:  # evaluations that ended since the last batch
                metrics.update(result)
            self.eval_results.clear()
            last = now
            await asyncio.to_thread(self._write_batch, RolloutBatch(step=n, samples=samples, metrics=metrics),
                                    position.record({src.name: [g.draw for g in src.batching if g.draw is not None]
                                                     for src in self.sources}))
            self.batches_written = n
            for src in self.sources:
                src.batching = []
            watchdog.advance()
            log(f"batch {n}: reward {metrics['reward/mean']:.3f}, staleness max {metrics['off_policy/max']}, "
                f"dropped {dropped}, inference v{self.version}")
            self._start_due_evaluations(n)

    def _write_batch(self, batch: RolloutBatch, position: dict[str, Any]) -> None:
        """The data position, then the batch (a trainer that sees the batch finds its position)."""
        write_atomically(self.run_dir.batch_state(batch.step), lambda tmp: tmp.write_text(json.dumps(position)))
        write_batch(self.run_dir.batch(batch.step), batch)

    def cancel_hopeless(self, next_batch: int) -> None:
        """Cancel in-flight groups that would be too stale even for the next batch."""
        for job, group in list(self.in_flight.items()):
            if not group.cancelled and (next_batch - 1) - group.start_version > self.o.max_off_policy_steps:
                group.cancelled = True  # no longer counted as started
                job.cancel()
                self.by_name[group.source].pending.pop(group.draw, None)

    async def run(self) -> None:
        """Run the loops until the last batch is written. The first of them to fail ends the
        run at once: its exception is raised (a :class:`PrimerlError` as it is, anything
        else as :class:`RunFailed` naming the loop), never left to a silent wait."""
        self.eval_tasks = self._eval_tasks() if self.o.eval_every else []
        watchdog.doing("waiting for the inference servers to answer /health")
        await self.client.wait_ready()
        self.broken = asyncio.get_running_loop().create_future()
        loops = {asyncio.create_task(self.watch_weights()): "the weight watcher",
                 asyncio.create_task(self.start_groups()): "the group starter (drawing tasks, starting groups)"}
        writer = asyncio.create_task(self.write_batches())
        loops[writer] = "the batch writer"
        jobs = [job for job in loops if job is not writer]
        try:
            await asyncio.wait([*loops, self.broken], return_when=asyncio.FIRST_COMPLETED)
            for job, what in loops.items():
                if job.done() and not job.cancelled() and job.exception() is not None:
                    exc = job.exception()
                    if isinstance(exc, (PrimerlError, RunFailed)):
                        raise exc
                    cause = " ".join(f"{type(exc).__name__}: {exc}".split())
                    raise RunFailed(f"{what} failed: {cause}") from exc
            if not writer.done():
                raise RunFailed(self.broken.result())
            writer.result()
        finally:
            self.closing = True
            for workers in self.workers():
                workers.closing = True
            others = [*jobs, writer, *self.in_flight, *self.evaluations]
            for job in others:
                job.cancel()
            await asyncio.gather(*others, return_exceptions=True)
            self.scorer.shutdown(wait=False, cancel_futures=True)
            for workers in self.workers():
                workers.close()


def main(cfg: RunConfig) -> None:
    watchdog.start("orchestrator", RunDir(cfg.output_dir), cfg)
    registry = get_registry()
    env = registry.load("env", cfg.env.name)(cfg.env)
    client = inference_client(cfg, servers=inference_urls(cfg), api_key=cfg.inference.resolved_api_key())
    # What exists now (modules, the env's tasks) lives as long as the run: frozen out of the
    # collector's sight, the occasional full collection scans only what rollouts make since
    # (in steady state the full ones took ~13% of this process's CPU on the quick start)
    gc.freeze()

    async def go() -> None:
        try:
            await Orchestrator(cfg, env, client).run()
        finally:
            await client.close()

    def on_term(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)  # unwinds run(): env workers are closed, scratch state released

    signal.signal(signal.SIGTERM, on_term)
    try:
        asyncio.run(go())
    except RunFailed as exc:
        log(f"error: stopping the run: {exc}")
        sys.exit(1)
    except PrimerlError as exc:
        log(f"error: {exc}")
        sys.exit(2)
    log(f"wrote {cfg.max_steps} batches; done")
    sys.stdout.flush()
