"""An env worker process killed mid-episode costs that rollout group, counted in
``errors/rollout``; a fresh group takes its place and the batch is written as usual."""

import asyncio
import os
import signal
import time

import pytest

from primerl.config import ConfigSources, load_config
from primerl.envs.multiturn import MultiTurnConfig
from primerl.envs.workers import EnvWorkers
from primerl.orchestrator.main import Orchestrator
from primerl.rundir import STABLE, RunDir
from primerl.samples import read_batch
from primerl.tokenizer import byte_tokenizer


class FakeInference:
    """Answers every completion with two sampled tokens from policy v0."""

    servers = ["fake"]

    async def wait_ready(self):
        pass

    async def load_weights(self, path, version):
        pass

    def servers_up(self):
        return self.servers

    async def completions(self, body, session):
        return {"choices": [{"token_ids": [65, 66], "logprobs": {"token_logprobs": [-1.0, -1.0]},
                             "policy_versions": [0, 0]}]}

    def take_metrics(self):
        return {}


@pytest.mark.slow
def test_an_env_worker_killed_mid_episode_costs_its_group_counted(tmp_path, monkeypatch):
    from stuck_env import DIR, Stuck

    stuck = tmp_path / "stuck"
    stuck.mkdir()
    monkeypatch.setenv(DIR, str(stuck))  # the spawned workers inherit it
    out = tmp_path / "run"
    overrides = [("output_dir", str(out)), ("max_steps", "1"), ("orchestrator.batch_size", "4"),
                 ("orchestrator.group_size", "2"), ("orchestrator.async_level", "0")]
    cfg = load_config(ConfigSources(overrides=overrides), {"env.name": "reverse-text"})
    cfg.env = MultiTurnConfig(name="stuck", turn_timeout_s=120, max_turns=2)
    env = Stuck(cfg.env)
    orch = Orchestrator(cfg, env, FakeInference())
    orch.env, orch.tokenizer = env, byte_tokenizer()
    orch.workers = EnvWorkers(Stuck, cfg.env, processes=2)
    orch.tasks = orch._task_stream(None)
    run = RunDir(out)
    run.weights_step(0).mkdir(parents=True)
    (run.weights_step(0) / STABLE).touch()  # v0 is published: the orchestrator may start

    async def kill_one_worker_mid_episode():
        deadline = time.monotonic() + 120
        while not list(stuck.glob("*.pid")):
            assert time.monotonic() < deadline, "no episode reached the env"
            await asyncio.sleep(0.05)
        victim = sorted(stuck.glob("*.pid"))[0]
        os.kill(int(victim.stem), signal.SIGKILL)
        await asyncio.sleep(0.5)
        (stuck / "go").touch()
        return victim.read_text()

    async def go():
        runner = asyncio.create_task(orch.run())
        killed_task = await kill_one_worker_mid_episode()
        await asyncio.wait_for(runner, 120)
        return killed_task

    killed_task = asyncio.run(go())
    batch = read_batch(run.batch(1))
    assert batch.metrics["errors/rollout"] == 1 and batch.metrics["errors/task"] == 0
    assert len(batch.samples) == 4 and all(s.reward == 1.0 for s in batch.samples)
    assert killed_task not in {s.task_id for s in batch.samples}  # its group was dropped, another took its place
    assert orch.workers.replaced >= 1
