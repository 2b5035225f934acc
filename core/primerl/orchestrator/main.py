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

Environments score completions here (``env.score``); tool and multi-turn environments
run their episodes through the same client, their turns computed in env worker processes.
An :class:`~primerl.envs.agent.AgentEnv` (the verifiers bridge, agent harnesses) runs
whole groups in a worker against the inference endpoint and returns its model calls,
which :func:`~primerl.envs.agent.interleave` turns into token-exact samples.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import signal
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs

from primerl.config import RunConfig
from primerl.envs import Environment, Task
from primerl.envs.agent import AgentEnv, Endpoint, interleave
from primerl.envs.multiturn import MultiTurnEnv, prompt_ids, turn_suffix
from primerl.envs.workers import EnvWorkers
from primerl.registry import get_registry
from primerl.rundir import SHM_LINK, STABLE, step_name


def log(msg: str) -> None:
    print(f"[orchestrator {time.strftime('%H:%M:%S')}] {msg}", flush=True)


@attrs.define
class Group:
    """The samples of one task, and the version of the policy when they were started."""

    task: Task
    start_version: int
    samples: list[dict[str, Any]] = attrs.Factory(list)
    tokens: int = 0
    cancelled: bool = False
    env_metrics: list[dict[str, float]] = attrs.Factory(list)  # an agent env's, one dict per episode

    @property
    def oldest_version(self) -> int:
        versions = [v for s in self.samples for v in s["versions"] if v >= 0]
        return min(versions, default=self.start_version)


class InferenceClient:
    """The OpenAI-compatible API plus primerl's admin endpoints, over one or more servers."""

    def __init__(self, urls: list[str], timeout: float = 600.0):
        import httpx

        self.urls = urls
        self.http = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=1024))
        self._rr = itertools.cycle(urls)

    async def wait_ready(self, deadline_s: float = 600.0) -> None:
        import httpx

        t0 = time.monotonic()
        for url in self.urls:
            while True:
                try:
                    if (await self.http.get(url + "/health", timeout=2)).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() - t0 > deadline_s:
                    raise RuntimeError(f"inference server {url} not ready after {deadline_s:.0f}s")
                await asyncio.sleep(0.2)

    def pick(self) -> str:
        """A server for work that must stay on one (an agent env's group: its prefix cache)."""
        return next(self._rr)

    async def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self._post("/v1/chat/completions", body)

    async def completions(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self._post("/v1/completions", body)

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        r = await self.http.post(next(self._rr) + path, json=body)
        if r.status_code != 200:
            raise RuntimeError(f"inference request failed ({r.status_code}): {r.text[:500]}")
        return r.json()

    async def load_weights(self, path: Path, version: int) -> None:
        for url in self.urls:
            r = await self.http.post(url + "/admin/weights", json={"path": str(path), "version": version})
            if r.status_code != 200:
                raise RuntimeError(f"{url} could not load weights {path}: {r.text[:500]}")

    async def close(self) -> None:
        await self.http.aclose()


class Orchestrator:
    def __init__(self, cfg: RunConfig, env: Environment, client: InferenceClient):
        self.cfg = cfg
        self.o = cfg.orchestrator
        self.env = env
        self.client = client
        self.out = Path(cfg.output_dir)
        self.groups_per_batch = self.o.batch_size // self.o.group_size
        self.version = -1  # newest version loaded into inference (-1: none yet)
        self.started = 0  # groups started (minus those refunded after a drop)
        self.finished: asyncio.Queue[Group] = asyncio.Queue()
        self.in_flight: dict[asyncio.Task, Group] = {}
        self.next_batch = 1
        self.tokens_since_batch = 0
        self.version_changed = asyncio.Event()
        self.tasks = self._task_stream()
        # rewards may call slow verifiers; one thread per in-flight sample keeps them overlapped
        self.scorer = ThreadPoolExecutor(max_workers=max(self.o.max_concurrent, self.o.group_size),
                                         thread_name_prefix="score")
        # multi-turn envs run in worker processes and need the tokenizer to append env turns
        # the engine's routed experts travel with each sample for R3 and the routing metrics
        self.want_routed = cfg.trainer.router_replay or cfg.trainer.routing_metrics
        self.workers: EnvWorkers | None = None
        self.closing = False
        self.tokenizer: Any = None
        if isinstance(env, MultiTurnEnv):
            self.workers = EnvWorkers(cfg.env.name, cfg.env, self.o.env_workers)
            self.tokenizer = get_registry().load("model", cfg.model.name)().tokenizer(cfg.model)
        elif isinstance(env, AgentEnv):
            self.workers = EnvWorkers(cfg.env.name, cfg.env, self.o.env_workers)

    def _task_stream(self) -> Iterator[Task]:
        rng = random.Random(self.cfg.seed)
        tasks = list(self.env.tasks("train"))
        if not tasks:
            raise ValueError(f"environment '{self.cfg.env.name}' has no train tasks")
        while True:
            rng.shuffle(tasks)
            yield from tasks

    # ---- weights ------------------------------------------------------------------------
    async def watch_weights(self) -> None:
        weights = self.out / "weights"
        while True:
            newest = self._newest_published(weights)
            if newest is not None and newest > self.version:
                path = weights / step_name(newest)
                if (path / SHM_LINK).exists():  # the trainer's co-located channel
                    path = path / SHM_LINK
                await self.client.load_weights(path, newest)
                self.version = newest
                self.version_changed.set()
                log(f"inference now serves policy v{newest}")
            await asyncio.sleep(0.05)

    @staticmethod
    def _newest_published(weights: Path) -> int | None:
        if not weights.is_dir():
            return None
        steps = [int(p.parent.name.split("_")[1]) for p in weights.glob(f"step_*/{STABLE}")]
        return max(steps, default=None)

    # ---- rollouts -------------------------------------------------------------------------
    def may_start(self) -> bool:
        allowed_batches = self.version + 1 + self.o.async_level
        samples_in_flight = len(self.in_flight) * self.o.group_size
        return (self.version >= 0 and self.started < allowed_batches * self.groups_per_batch
                and samples_in_flight + self.o.group_size <= max(self.o.max_concurrent, self.o.group_size))

    async def start_groups(self) -> None:
        while True:
            while self.may_start():
                task = next(self.tasks)
                group = Group(task=task, start_version=self.version)
                job = asyncio.create_task(self.rollout(group))
                self.in_flight[job] = group
                job.add_done_callback(self._on_done)
                self.started += 1
            self.version_changed.clear()
            try:
                await asyncio.wait_for(self.version_changed.wait(), timeout=0.05)
            except asyncio.TimeoutError:
                pass

    def _on_done(self, job: asyncio.Task) -> None:
        group = self.in_flight.pop(job)
        if job.cancelled():
            return
        if job.exception() is not None:
            log(f"rollout of task {group.task.id} failed: {job.exception()!r}; starting another")
            self.started -= 1
            return
        self.finished.put_nowait(group)

    async def rollout(self, group: Group) -> None:
        if isinstance(self.env, AgentEnv):
            await self.agent_rollout(group)
            return
        if self.workers is not None:
            await self.multi_turn_rollout(group)
            return
        o = self.o
        body = {
            "model": self.cfg.model.name,
            "messages": group.task.messages(self.env.system_prompt),
            "n": o.group_size, "max_tokens": o.max_tokens, "temperature": o.temperature, "top_p": o.top_p,
            "logprobs": True, "return_routed_experts": self.want_routed,
        }
        resp = await self.client.chat(body)
        prompt_ids = resp["prompt_token_ids"]
        loop = asyncio.get_running_loop()
        rewards = await asyncio.gather(*(  # score the group's samples concurrently
            loop.run_in_executor(self.scorer, self.env.score, group.task, c["message"]["content"] or "")
            for c in resp["choices"]
        ))
        for choice, reward in zip(resp["choices"], rewards):
            ids = choice["token_ids"]
            logprobs = [c["logprob"] for c in choice["logprobs"]["content"]]
            n_prompt = len(prompt_ids)
            group.samples.append({
                "tokens": prompt_ids + ids,
                "loss_mask": [0] * n_prompt + [1] * len(ids),
                "logprobs": [0.0] * n_prompt + logprobs,
                "versions": [-1] * n_prompt + choice["policy_versions"],
                "reward": reward,
                "temperature": o.temperature,
                "routed_experts": _decode_routed(choice.get("routed_experts")),
                "task_id": group.task.id,
            })
            group.tokens += len(ids)
        self.tokens_since_batch += group.tokens

    async def multi_turn_rollout(self, group: Group) -> None:
        """``group_size`` independent episodes of one task; any failed episode fails the group."""
        timeout = getattr(self.cfg.env, "episode_timeout_s", None)
        episodes = await asyncio.gather(*(asyncio.wait_for(self.episode(group.task), timeout)
                                          for _ in range(self.o.group_size)))
        for sample in episodes:
            group.samples.append(sample)
            group.tokens += sum(sample["loss_mask"])
        self.tokens_since_batch += group.tokens

    async def agent_rollout(self, group: Group) -> None:
        """The env runs the group in a worker; every episode's calls become samples."""
        o = self.o
        endpoint = Endpoint(
            base_url=self.client.pick() + "/v1", model=self.cfg.model.name, max_tokens=o.max_tokens,
            temperature=o.temperature, top_p=o.top_p, max_model_len=self.cfg.inference.max_model_len,
            return_routed_experts=self.want_routed)
        timeout = getattr(self.cfg.env, "episode_timeout_s", None)
        episodes = await self.workers.call("run_group", group.task, endpoint, o.group_size, timeout=timeout)
        for i, ep in enumerate(episodes):
            if ep.error:
                log(f"episode of task {group.task.id} ended early: {ep.error}")
            group.env_metrics.append(ep.metrics)
            for sample in interleave(ep.calls):
                sample.update(reward=float(ep.reward), temperature=o.temperature, task_id=group.task.id, episode=i,
                              routed_experts=_decode_routed(sample["routed_experts"]))
                group.samples.append(sample)
                group.tokens += sum(sample["loss_mask"])
        if not group.samples:
            raise RuntimeError(f"no episode of task {group.task.id} sampled a token")
        self.tokens_since_batch += group.tokens

    async def episode(self, task: Task) -> dict[str, Any]:
        """One token-exact multi-turn episode: model turns via /v1/completions on the
        growing token sequence, env turns from the env workers, appended as tokens."""
        o, env, tok = self.o, self.env, self.tokenizer
        turn_timeout = getattr(self.cfg.env, "turn_timeout_s", None)
        max_turns = getattr(self.cfg.env, "max_turns", 8)
        max_len = self.cfg.inference.max_model_len
        state = await self.workers.call("setup", task, timeout=turn_timeout)
        try:
            messages = task.messages(env.system())
            ids = prompt_ids(tok, messages)
            mask, logprobs, versions = [0] * len(ids), [0.0] * len(ids), [-1] * len(ids)
            routed, end = None, len(ids)
            for _ in range(max_turns):
                budget = min(o.max_tokens, max_len - len(ids) - 1)
                if budget <= 0:
                    break
                resp = await self.client.completions({
                    "model": self.cfg.model.name, "prompt": ids, "max_tokens": budget,
                    "temperature": o.temperature, "top_p": o.top_p, "logprobs": 0,
                    "return_routed_experts": self.want_routed,
                })
                choice = resp["choices"][0]
                out = choice["token_ids"]
                ids, mask = ids + out, mask + [1] * len(out)
                logprobs += choice["logprobs"]["token_logprobs"]
                versions += choice["policy_versions"]
                routed = choice.get("routed_experts") or routed
                end = len(ids)  # the trajectory ends with a model turn: later env tokens teach nothing
                text = tok.decode(out, skip_special_tokens=True)
                turn = await self.workers.call("step", task, state, text, timeout=turn_timeout)
                state = turn.state
                messages = messages + [{"role": "assistant", "content": text}]
                if turn.done or not turn.messages:
                    break
                delta = turn_suffix(tok, messages, turn.messages)
                messages = messages + turn.messages
                if len(ids) + len(delta) >= max_len:
                    break  # no room for another model turn
                ids, mask = ids + delta, mask + [0] * len(delta)
                logprobs, versions = logprobs + [0.0] * len(delta), versions + [-1] * len(delta)
            reward = await self.workers.call("score", task, state, timeout=turn_timeout)
        finally:
            try:
                if not self.closing:  # at shutdown the workers' env.close() releases everything
                    await self.workers.call("cleanup", task, state, timeout=turn_timeout)
            except Exception as e:  # noqa: BLE001 - cleanup failing must not lose the episode
                log(f"cleanup of task {task.id} failed: {e}")
        ids, mask, logprobs, versions = ids[:end], mask[:end], logprobs[:end], versions[:end]
        return {"tokens": ids, "loss_mask": mask, "logprobs": logprobs, "versions": versions, "reward": reward,
                "temperature": o.temperature, "routed_experts": _decode_routed(routed), "task_id": task.id,
                "turns": sum(1 for m in messages if m["role"] == "assistant")}

    # ---- batches --------------------------------------------------------------------------
    async def write_batches(self) -> None:
        from primerl.trainer.loss import compute_advantages

        last = time.monotonic()
        for n in range(1, self.cfg.max_steps + 1):
            groups: list[Group] = []
            dropped = 0
            while len(groups) < self.groups_per_batch:
                group = await self.finished.get()
                staleness = (n - 1) - group.oldest_version
                if staleness > self.o.max_off_policy_steps:
                    dropped += len(group.samples)
                    self.started -= 1  # let a fresh group take its place
                    continue
                groups.append(group)
            self.cancel_hopeless(n + 1)
            samples = []
            for g in groups:
                # one advantage per episode (an agent env's episode may train as several samples)
                episodes = {s.get("episode", i): s["reward"] for i, s in enumerate(g.samples)}
                advantage = dict(zip(episodes, compute_advantages(list(episodes.values()), self.o.advantage)))
                for i, s in enumerate(g.samples):
                    samples.append({**s, "advantage": float(advantage[s.get("episode", i)])})
            now = time.monotonic()
            rewards = [s["reward"] for s in samples]
            staleness = [(n - 1) - g.oldest_version for g in groups]
            metrics = {
                "step": n,
                "reward/mean": sum(rewards) / len(rewards),
                "reward/max": max(rewards),
                "reward/min": min(rewards),
                "off_policy/max": max(staleness),
                "off_policy/mean": sum(staleness) / len(staleness),
                "dropped_stale": dropped,
                "inference/policy_version": self.version,
                "throughput/tokens_per_s": self.tokens_since_batch / max(now - last, 1e-9),
                "orchestrator/batch_seconds": now - last,
                "seq_len/mean": sum(len(s["tokens"]) for s in samples) / len(samples),
                "completion_len/mean": sum(sum(s["loss_mask"]) for s in samples) / len(samples),
            }
            if "turns" in samples[0]:
                metrics["turns/mean"] = sum(s["turns"] for s in samples) / len(samples)
            env_metrics = [m for g in groups for m in g.env_metrics]
            for key in sorted({k for m in env_metrics for k in m}):  # an agent env's own metrics, per episode
                values = [m[key] for m in env_metrics if key in m]
                metrics[f"env/{key}"] = sum(values) / len(values)
            self.tokens_since_batch = 0
            last = now
            self.next_batch = n + 1
            await asyncio.to_thread(write_batch, self.out / "rollouts" / f"{step_name(n)}.pt",
                                    {"step": n, "samples": samples, "metrics": metrics})
            log(f"batch {n}: reward {metrics['reward/mean']:.3f}, staleness max {metrics['off_policy/max']}, "
                f"dropped {dropped}, inference v{self.version}")

    def cancel_hopeless(self, next_batch: int) -> None:
        """Cancel in-flight groups that would be too stale even for the next batch."""
        for job, group in list(self.in_flight.items()):
            if not group.cancelled and (next_batch - 1) - group.start_version > self.o.max_off_policy_steps:
                group.cancelled = True
                job.cancel()
                self.started -= 1

    async def run(self) -> None:
        await self.client.wait_ready()
        jobs = [asyncio.create_task(self.watch_weights()), asyncio.create_task(self.start_groups())]
        try:
            await self.write_batches()
        finally:
            self.closing = True
            if self.workers is not None:
                self.workers.closing = True
            for job in [*jobs, *self.in_flight]:
                job.cancel()
            await asyncio.gather(*jobs, *self.in_flight, return_exceptions=True)
            self.scorer.shutdown(wait=False, cancel_futures=True)
            if self.workers is not None:
                self.workers.close()


def write_batch(path: Path, batch: dict[str, Any]) -> None:
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(batch, tmp)
    os.replace(tmp, path)


def _decode_routed(obj: dict[str, Any] | None):
    if not obj:
        return None
    import base64

    import numpy as np
    import torch

    if obj.get("start", 0) != 0:
        raise ValueError(f"routed experts that start at token {obj['start']} cannot be aligned with the sample")
    data = obj["data"]  # base64 text, or its raw bytes (verifiers' sidecar hands a memoryview)
    arr = np.frombuffer(base64.b64decode(bytes(data) if not isinstance(data, str) else data),
                        dtype=obj["dtype"]).reshape(obj["shape"])
    return torch.from_numpy(arr.copy())


def inference_urls(cfg: RunConfig) -> list[str]:
    return [f"http://{cfg.inference.host}:{cfg.inference.port}"]


def main(cfg: RunConfig) -> None:
    env_cls = get_registry().load("env", cfg.env.name)
    env = env_cls(cfg.env)
    client = InferenceClient(inference_urls(cfg))

    async def go() -> None:
        try:
            await Orchestrator(cfg, env, client).run()
        finally:
            await client.close()

    def on_term(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)  # unwinds run(): env workers are closed, scratch state released

    signal.signal(signal.SIGTERM, on_term)
    asyncio.run(go())
    log(f"wrote {cfg.max_steps} batches; done")
    sys.stdout.flush()
