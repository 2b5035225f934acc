"""A failure in one of the orchestrator's own loops (drawing tasks, starting groups, writing
batches, watching weights) ends the run at once with its cause in one line, never a silent
wait. Each loop is made to fail against a real inference server serving real v0 weights."""

import asyncio
import time

import pytest
from conftest import publish_v0

from primerl.config import ConfigSources, load_config
from primerl.envs import SingleTurnEnv, Task
from primerl.errors import PrimerlError
from primerl.inference import inference_urls
from primerl.orchestrator import main as orchestrator_main
from primerl.orchestrator.main import Orchestrator, RunFailed
from primerl.registry import get_registry

pytestmark = pytest.mark.slow  # every test runs against a real inference server


def _config(out, server):
    overrides = [("output_dir", str(out)), ("max_steps", "2"), ("orchestrator.batch_size", "4"),
                 ("orchestrator.group_size", "2"), ("orchestrator.max_tokens", "4"),
                 ("inference.urls", f'["{server.url}"]')]
    return load_config(ConfigSources(overrides=overrides), {"env.name": "reverse-text", "model.name": "glm5"})


def _run(cfg, env, seconds=120):
    from primerl.orchestrator.client import inference_client

    async def go():
        client = inference_client(cfg, servers=inference_urls(cfg))
        try:
            await asyncio.wait_for(Orchestrator(cfg, env, client).run(), seconds)
        finally:
            await client.close()

    t0 = time.monotonic()
    try:
        asyncio.run(go())
    finally:
        elapsed = time.monotonic() - t0
        assert elapsed < 60, f"the run took {elapsed:.0f}s to end"


class NoTasks(SingleTurnEnv):
    def tasks(self, split):
        raise ValueError("the task file /data/tasks.jsonl is gone")

    def reward(self, task, completion):
        return 0.0


class NotTasks(SingleTurnEnv):
    def tasks(self, split):
        yield from range(3)

    def reward(self, task, completion):
        return 0.0


class Echo(SingleTurnEnv):
    def tasks(self, split):
        for i in range(8):
            yield Task(id=str(i), prompt=f"say {i}")

    def reward(self, task, completion):
        return 0.5


def test_drawing_tasks_that_raises_ends_the_run(tmp_path, glm5_server, glm5_v0):
    out = tmp_path / "run"
    publish_v0(out, glm5_v0)
    cfg = _config(out, glm5_server)
    with pytest.raises(RunFailed) as err:
        _run(cfg, NoTasks(cfg.env))
    assert str(err.value) == ("the group starter (drawing tasks, starting groups) failed: "
                              "ValueError: the task file /data/tasks.jsonl is gone")


def test_starting_a_group_that_raises_ends_the_run(tmp_path, glm5_server, glm5_v0):
    out = tmp_path / "run"
    publish_v0(out, glm5_v0)
    cfg = _config(out, glm5_server)
    with pytest.raises(RunFailed, match="the group starter .* failed: TypeError: environment 'reverse-text' "
                                        "yielded a int from its train split, not a primerl.envs.Task"):
        _run(cfg, NotTasks(cfg.env))


def test_a_user_error_while_drawing_keeps_its_own_message(tmp_path, glm5_server, glm5_v0):
    out = tmp_path / "run"
    publish_v0(out, glm5_v0)
    cfg = _config(out, glm5_server)

    class BadFile(NoTasks):
        def tasks(self, split):
            raise PrimerlError("tasks.jsonl:3: not JSON (Expecting value at column 1)")

    with pytest.raises(PrimerlError, match=r"^tasks.jsonl:3: not JSON"):
        _run(cfg, BadFile(cfg.env))


def test_writing_a_batch_that_fails_ends_the_run(tmp_path, glm5_server, glm5_v0):
    out = tmp_path / "run"
    publish_v0(out, glm5_v0)
    cfg = _config(out, glm5_server)
    (out / "rollouts").mkdir(exist_ok=True)
    (out / "rollouts").chmod(0o500)  # batches cannot be written (root ignores modes: a file instead)
    if (out / "rollouts").stat().st_uid == 0:
        (out / "rollouts").chmod(0o700)
        (out / "rollouts").rmdir()
        (out / "rollouts").write_text("not a folder")
    with pytest.raises(RunFailed, match=r"^the batch writer failed: (NotADirectoryError|FileExistsError|PermissionError)"):
        _run(cfg, Echo(cfg.env))


def test_weights_inference_refuses_end_the_run(tmp_path, glm5_server, glm5_v0):
    out = tmp_path / "run"
    publish_v0(out, None)  # published (STABLE) but holding no weights
    cfg = _config(out, glm5_server)
    with pytest.raises(RunFailed, match=r"^the weight watcher failed: RuntimeError: .* could not load weights"):
        _run(cfg, Echo(cfg.env))


def test_the_process_prints_the_cause_in_one_line_and_exits_1(tmp_path, glm5_server, glm5_v0, capsys, monkeypatch):
    out = tmp_path / "run"
    publish_v0(out, glm5_v0)
    cfg = _config(out, glm5_server)
    registry, load = get_registry(), get_registry().load
    monkeypatch.setattr(registry, "load", lambda kind, name: NoTasks if kind == "env" else load(kind, name))
    with pytest.raises(SystemExit) as code:
        orchestrator_main.main(cfg)
    assert code.value.code == 1
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if "error:" in ln]
    assert line.endswith("error: stopping the run: the group starter (drawing tasks, starting groups) failed: "
                         "ValueError: the task file /data/tasks.jsonl is gone")
