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
* **batch writer** — batch after batch, the stages a finished group goes through, each a
  module beside this one: fill batch n with each source's first groups to finish that the
  filters admit (:mod:`.batching`, :mod:`.filters`: a long-tail rollout never holds a batch
  back, a group more than ``max_off_policy_steps`` behind n - 1 is dropped, a uniform one
  skipped when asked), cancel in-flight groups that can no longer qualify, set every
  sample's advantage (:mod:`.advantages`), add the batch's metrics (:mod:`.metrics`) and
  write ``rollouts/step_n.pt`` atomically with its data position (:mod:`.positions`).

Two more run beside them when asked: every ``eval_every`` batches an **evaluation** of
the env's eval split, logged with the next batch; and failed groups are counted
(:mod:`.failures`: ``errors/task``, ``errors/rollout``) until ``max_failed_groups`` in a
row say the env cannot run its tasks, which stops the run with the cause.

Resuming: the orchestrator takes the checkpoint the trainer takes
(``primerl.resume.usable_checkpoint``), reads its data position, replays each source's
draws up to it (:class:`~primerl.orchestrator.sources.Source`), starts the unbatched tasks
first and writes batches s+1..: the same task order as a run that was never stopped.

Requests reach the inference servers (``inference.replicas`` of them) through the router
plugin (``inference.router``) and :class:`~primerl.orchestrator.client.InferenceClient`,
which ejects a dead server, re-sends its requests to another and readmits it with the
current weights (``inference/resent``, ``inference/servers_up`` in each batch's metrics);
samples leave as :class:`~primerl.samples.Sample` records, paths come from
:class:`~primerl.rundir.RunDir`.

A group's samples come from its source's rollout kind (:class:`primerl.envs.rollouts.Rollout`,
named by ``env.rollout``; :meth:`Orchestrator.rollout` calls its ``run``): single-turn (one
chat request with ``n``, the env scores each completion), multi-turn (token-exact episodes,
the env's turns computed in its worker processes), or agent (the env runs the whole group in
a worker against an inference endpoint; the verifiers bridge, agent harnesses). How many
groups are started is derived from where they are (:attr:`Orchestrator.started`), never
counted up and down by hand.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from primerl import watchdog
from primerl.algorithms import OverlongShaping, build_advantage
from primerl.config import EvalSourceConfig, RunConfig
from primerl.envs import EnvConfig, Environment, Task
from primerl.envs.rollouts import Rollout, rollout_kind
from primerl.envs.workers import EnvWorkers
from primerl.errors import PrimerlError
from primerl.evaluation import run_metrics, score_tasks, summarize
from primerl.inference import inference_urls
from primerl.orchestrator import log
from primerl.orchestrator.advantages import assign_advantages
from primerl.orchestrator.batching import fill, position_record, write_batch_files
from primerl.orchestrator.client import Client, inference_client
from primerl.orchestrator.failures import Failures
from primerl.orchestrator.filters import SKIP_UNIFORM_MAX, GroupFilter
from primerl.orchestrator.groups import Group
from primerl.orchestrator.metrics import batch_metrics, shaping_metrics
from primerl.orchestrator.positions import read_position
from primerl.orchestrator.sources import Source
from primerl.registry import get_registry
from primerl.resume import usable_checkpoint
from primerl.rundir import RunDir
from primerl.samples import RolloutBatch


class RunFailed(Exception):
    """The run cannot go on: the env cannot run its tasks. The message names the cause."""


class Orchestrator:
    """The orchestrator's state and its loops (see the module docstring): the sources and
    their draws, the groups in flight, the policy version inference serves, the stages'
    counters, the evaluations; :meth:`run` runs the loops until the last batch is written."""

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
        self.filters = GroupFilter(max_off_policy_steps=self.o.max_off_policy_steps,
                                   skip_uniform=self.o.skip_uniform_groups,
                                   skip_limit=SKIP_UNIFORM_MAX * self.groups_per_batch)
        self.shaping = OverlongShaping(max_tokens=self.o.max_tokens, buffer=self.o.overlong_buffer,
                                       penalty=self.o.overlong_penalty)
        self.eval_sources: list[tuple[EvalSourceConfig, Environment, Rollout, EnvWorkers | None]] = []
        for ec in self.o.eval_sources:
            env_e = get_registry().load("env", ec.env.name)(ec.env)
            self.eval_sources.append((ec, env_e, *self._rollout_kind(env_e, ec.env)))
        # resuming: the trainer continues from the same checkpoint (the same choice, made alike)
        found = usable_checkpoint(self.run_dir, log=log)
        self.resume_step = found[0] if found is not None else 0
        self._continue_draws(resuming=found is not None)
        self.batches_written = self.resume_step  # batches before a resume included
        self.eval_tasks: list[Task] = []  # the eval split's first eval_tasks tasks, read at start when eval_every
        self.eval_results: list[dict[str, float]] = []  # finished evaluations, logged with the next batch
        self.evaluations: set[asyncio.Task] = set()

    def _continue_draws(self, resuming: bool) -> None:
        """Every source's draws from the data position of the checkpoint resumed from (from
        the start when none)."""
        quotas = {src.name: src.quota for src in self.sources}
        position = read_position(self.run_dir, self.resume_step, quotas) if resuming else None
        for src in self.sources:
            at = position.sources.get(src.name) if position is not None else None
            if position is not None and at is None:
                log(f"source {src.name!r} has no data position in the checkpoint (added since): its draws start over")
            src.resume_at(at)

    def _rollout_kind(self, env: Environment, env_cfg: EnvConfig) -> tuple[Rollout, EnvWorkers | None]:
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

    def _eval_tasks(self) -> list[Task]:
        tasks = list(itertools.islice(self.sources[0].env.tasks("eval"), self.o.eval_tasks))
        if not tasks:
            raise RunFailed(f"environment '{self.cfg.env.name}' has no eval tasks: set orchestrator.eval_every 0")
        return tasks

    async def evaluate(self, after_batch: int, kind: Rollout | None = None, tasks: list[Task] | None = None,
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
                    draw, task = src.draw()
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

    async def rollout(self, group: Group, kind: Rollout) -> None:
        """Fill ``group.samples`` with ``kind`` (its source's rollout kind)."""
        await kind.run(group)

    # ---- batches --------------------------------------------------------------------------
    async def write_batches(self) -> None:
        """Batch after batch until ``max_steps``: fill it (:mod:`.batching`, through the
        filters), cancel what can no longer qualify, set advantages (:mod:`.advantages`),
        add its metrics (:mod:`.metrics`) and the evaluations that ended, write it."""
        last = time.monotonic()
        for n in range(self.resume_step + 1, self.cfg.max_steps + 1):
            for src in self.sources:  # each its quota of groups, the first of them to finish
                await fill(src, n, self.filters)
            self.cancel_hopeless(n + 1)
            position = position_record(n, self.sources)
            advantaged = [assign_advantages(src.batching, src.advantage, self.shaping, source=src.name,
                                            estimator_name=src.cfg.advantage) for src in self.sources]
            samples = [s for a in advantaged for s in a.samples]
            now = time.monotonic()
            counts = {**self.filters.take_metrics(),
                      **shaping_metrics(self.shaping, [p for a in advantaged for p in a.penalties]),
                      **self.failures.take_metrics(), **self.client.take_metrics()}
            metrics = batch_metrics(n, {src.name: src.batching for src in self.sources}, samples, counts=counts,
                                    policy_version=self.version, seconds=now - last)
            for result in self.eval_results:  # evaluations that ended since the last batch
                metrics.update(result)
            self.eval_results.clear()
            last = now
            await asyncio.to_thread(write_batch_files, self.run_dir, RolloutBatch(step=n, samples=samples,
                                                                                  metrics=metrics), position)
            self.batches_written = n
            for src in self.sources:
                src.batching = []
            watchdog.advance()
            log(f"batch {n}: reward {metrics['reward/mean']:.3f}, staleness max {metrics['off_policy/max']}, "
                f"dropped {counts['dropped_stale']}, inference v{self.version}")
            self._start_due_evaluations(n)

    def cancel_hopeless(self, next_batch: int) -> None:
        """Cancel in-flight groups that would be too stale even for the next batch."""
        for job, group in list(self.in_flight.items()):
            if not group.cancelled and self.filters.hopeless(group, next_batch):
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
