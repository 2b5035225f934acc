"""The verifiers bridge on verifiers 0.4 (``verifiers.v1``): v1 environments written as its
docs show (examples/verifiers-v1-env), run by verifiers' own train client against a real
`primerl inference` process. Runs where verifiers 0.4 is installed (CI: its own venv)."""

import json
import subprocess
import sys

import httpx
import pytest

pytest.importorskip("verifiers.v1")
pytest.importorskip("vf_reverse_v1")

from conftest import InferenceServer

from primerl.config import ConfigError, ConfigSources, load_config
from primerl.envs.agent import Endpoint, interleave


def config(**kw):
    from primerl_verifiers.env import VerifiersConfig

    return VerifiersConfig(**{"name": "verifiers", "id": "vf-reverse-v1", "args": {"num_tasks": 20}, **kw})


@pytest.fixture(scope="module")
def server():
    with InferenceServer("--model", "glm5", "--inference.max_model_len", "512") as s:
        yield s


def endpoint(server, **kw):
    return Endpoint(**{"base_url": server.url + "/v1", "model": "glm5", "max_tokens": 12, "temperature": 1.0,
                       "max_model_len": 512, **kw})


def test_tasks_come_from_the_taskset():
    from primerl_verifiers.env import VerifiersEnv

    tasks = list(VerifiersEnv(config()).tasks("train"))
    assert len(tasks) == 20 and tasks[0].id == "vf-reverse-v1/r0"
    assert tasks[0].prompt.startswith("Reverse the text: ") and tasks[0].answer == tasks[0].prompt.split(": ")[1][::-1]
    assert list(VerifiersEnv(config()).tasks("eval")) == []


@pytest.mark.slow
def test_a_group_is_token_exact_with_the_engines_logprobs(server):
    """Each trace's branch is what the engine ran: the sample's tokens are the branch's, its
    loss mask the sampled spans, its logprobs the server's own scoring of those tokens."""
    from primerl_verifiers.env import VerifiersEnv

    env = VerifiersEnv(config())
    task = next(iter(env.tasks("train")))
    episodes = env.run_group(task, endpoint(server), 3)
    assert len(episodes) == 3
    for ep in episodes:
        assert ep.error is None and 0.0 <= ep.reward <= 1.0 and "exact" in ep.metrics
        (call,) = ep.calls  # single turn: one model call
        (sample,) = interleave(ep.calls)
        assert sample.tokens == call.prompt_ids + call.completion_ids
        assert sample.loss_mask == [0] * len(call.prompt_ids) + [1] * len(call.completion_ids)
        scored = httpx.post(server.url + "/v1/completions", json={"prompt": sample.tokens, "max_tokens": 0,
                                                                 "echo": True, "logprobs": 0}, timeout=60).json()
        echo = scored["choices"][0]["logprobs"]["token_logprobs"][len(call.prompt_ids):]
        assert call.logprobs == pytest.approx(echo, abs=1e-4)
    env.close()


@pytest.mark.slow
def test_a_multi_turn_tool_env_runs_a_group(server):
    """vf-reverse-tool-v1: the null harness offers the task's MCP tool; whatever the tiny
    model does with it, every model turn's sampled tokens train and the rest does not."""
    from primerl_verifiers.env import VerifiersEnv

    env = VerifiersEnv(config(id="vf-reverse-tool-v1", args={}, max_turns=3))
    task = next(iter(env.tasks("train")))
    episodes = env.run_group(task, endpoint(server, max_tokens=24), 2)
    assert len(episodes) == 2
    for ep in episodes:
        assert ep.calls and all(len(c.completion_ids) == len(c.logprobs) for c in ep.calls)
        for sample in interleave(ep.calls):
            assert sum(sample.loss_mask) == sum(len(c.completion_ids) for c in ep.calls
                                                if sample.tokens[: len(c.prompt_ids)] == c.prompt_ids)
    env.close()


def test_bad_config_is_one_line():
    from primerl_verifiers.env import VerifiersEnv

    with pytest.raises(ConfigError, match="env.id.*--env.id"):
        load_config(ConfigSources(overrides=[("env.name", "verifiers")]))
    with pytest.raises(ConfigError, match="env.max_turns"):
        load_config(ConfigSources(overrides=[("env.name", "verifiers"), ("env.id", "vf-reverse-v1"),
                                             ("env.max_turns", "0")]))
    with pytest.raises(ValueError, match="could not load environment 'vf-no-such-env'.*install it"):
        list(VerifiersEnv(config(id="vf-no-such-env")).tasks("train"))


@pytest.mark.slow
def test_a_v1_env_trains_end_to_end(tmp_path):
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "primerl.cli", "run", "--model", "glm5", "--env", "verifiers",
                        "--env.id", "vf-reverse-v1", "--max-steps", "3", "--orchestrator.batch_size", "8",
                        "--orchestrator.group_size", "4", "--orchestrator.max_tokens", "12", "--output-dir", str(out)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3] and all(row["errors/rollout"] == 0 for row in rows)
