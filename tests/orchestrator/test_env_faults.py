"""An env worker process killed mid-episode costs that rollout group, counted in
``errors/rollout``; a fresh group takes its place and the batch is written as usual (a real
inference server serving real v0 weights; the env's workers are real processes)."""

import asyncio
import os
import signal
import time

import pytest
from conftest import publish_v0

from primerl.config import ConfigSources, load_config
from primerl.envs.multiturn import MultiTurnConfig
from primerl.inference import inference_urls
from primerl.orchestrator.client import inference_client
from primerl.orchestrator.main import Orchestrator
from primerl.rundir import RunDir
from primerl.samples import read_batch


@pytest.mark.slow
def test_an_env_worker_killed_mid_episode_costs_its_group_counted(tmp_path, monkeypatch, glm5_server, glm5_v0):
    from stuck_env import DIR, Stuck

    stuck = tmp_path / "stuck"
    stuck.mkdir()
    monkeypatch.setenv(DIR, str(stuck))  # the spawned workers inherit it
    out = tmp_path / "run"
    overrides = [("output_dir", str(out)), ("max_steps", "1"), ("orchestrator.batch_size", "4"),
                 ("orchestrator.group_size", "2"), ("orchestrator.async_level", "0"),
                 ("orchestrator.max_tokens", "2"), ("orchestrator.env_workers", "2"),
                 ("inference.urls", f'["{glm5_server.url}"]')]
    cfg = load_config(ConfigSources(overrides=overrides), {"env.name": "reverse-text", "model.name": "glm5"})
    cfg.env = MultiTurnConfig(name="stuck", turn_timeout_s=120, max_turns=2)
    publish_v0(out, glm5_v0)  # v0 is published: the orchestrator may start
    client = inference_client(cfg, servers=inference_urls(cfg))
    orch = Orchestrator(cfg, Stuck(cfg.env), client)  # its workers run the Stuck class
    run = RunDir(out)

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
        try:
            killed_task = await kill_one_worker_mid_episode()
            await asyncio.wait_for(runner, 120)
        finally:
            await client.close()
        return killed_task

    killed_task = asyncio.run(go())
    batch = read_batch(run.batch(1))
    assert batch.metrics["errors/rollout"] == 1 and batch.metrics["errors/task"] == 0
    assert len(batch.samples) == 4 and all(s.reward == 1.0 for s in batch.samples)
    assert killed_task not in {s.task_id for s in batch.samples}  # its group was dropped, another took its place
    assert orch.sources[0].workers.replaced >= 1
