"""``primerl eval`` and :mod:`primerl.evaluation`: a model's score on an env's tasks, the same
figures a run logs as ``eval/...``."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import pytest

from primerl.evaluation import TaskScore, ks_for, pass_at_k, run_metrics, summarize


def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 3) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - math.comb(3, 2) / math.comb(4, 2))  # 0.5
    assert pass_at_k(5, 2, 4) == 1.0  # n - c < k: any 4 of 5 include a pass
    assert ks_for(1) == [1] and ks_for(4) == [1, 2, 4] and ks_for(6) == [1, 2, 4, 6]


def test_summary_counts_tasks_episodes_and_errors():
    scores = [TaskScore("a", (1.0, 0.0)), TaskScore("b", (0.5, 0.5)), TaskScore("c", (), error="boom")]
    s = summarize(scores)
    assert s["n"] == 2 and s["errors"] == 1 and s["samples"] == 2
    assert s["mean_reward"] == pytest.approx(0.5)  # over every episode of the tasks that ran
    assert s["pass@1"] == pytest.approx(0.25) and s["pass@2"] == pytest.approx(0.5)
    assert s["reward_stderr"] == pytest.approx(0.0)  # both tasks' means are 0.5
    m = run_metrics(s, "eval")
    assert m == {"eval/tasks": 2, "eval/errors": 1, "eval/reward/mean": pytest.approx(0.5),
                 "eval/pass@1": pytest.approx(0.25), "eval/pass@2": pytest.approx(0.5)}
    assert summarize([TaskScore("c", (), error="boom")])["mean_reward"] is None


def primerl(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "primerl.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_eval_scores_a_preset_with_json_lines_and_a_summary(tmp_path):
    out = tmp_path / "lines.jsonl"
    r = primerl("eval", "--model", "glm5", "--env", "reverse-text", "--tasks", "6", "--samples", "2",
                "--temperature", "1", "--max-tokens", "6", "--json", "--output", str(out), "--inference.port", "0")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    tasks, summary = lines[:-1], lines[-1]
    assert [t["task_id"] for t in tasks] == [f"eval-{i}" for i in range(6)]
    assert all(len(t["rewards"]) == 2 and isinstance(t["completion"], str) for t in tasks)
    assert summary["n"] == 6 and summary["samples"] == 2 and summary["errors"] == 0
    assert {"mean_reward", "reward_stderr", "pass@1", "pass@2", "model", "env", "split"} <= set(summary)
    assert summary["mean_reward"] == pytest.approx(sum(r for t in tasks for r in t["rewards"]) / 12)
    assert [json.loads(x)["task_id"] for x in out.read_text().splitlines()[:-1]] == [t["task_id"] for t in tasks]


@pytest.mark.slow
def test_a_split_smaller_than_tasks_is_scored_whole_and_said():
    r = primerl("eval", "--model", "glm5", "--env", "reverse-text", "--env.num_eval", "3", "--tasks", "5",
                "--max-tokens", "4", "--json", "--inference.port", "0")
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout.splitlines()[-1])["n"] == 3
    assert "has 3 tasks, fewer than --tasks 5" in r.stderr


@pytest.mark.slow
def test_eval_of_a_run_scores_its_checkpoint(tmp_path):
    """``--run OUT`` takes the run's config and its newest checkpoint's weights; a step it
    does not hold, or a directory that is not a run, is one line."""
    run = tmp_path / "run"
    r = primerl("run", "--model", "glm5", "--env", "reverse-text", "--max-steps", "2", "--output-dir", str(run),
                "--sft.steps", "0", "--orchestrator.batch_size", "8", "--orchestrator.group_size", "4",
                "--orchestrator.max_tokens", "6", "--trainer.seq_len", "256", "--inference.port", "0")
    assert r.returncode == 0, r.stdout + r.stderr
    r = primerl("eval", "--run", str(run), "--tasks", "4", "--json", "--inference.port", "0")
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads(r.stdout.splitlines()[-1])
    assert summary["n"] == 4 and summary["checkpoint"].endswith("checkpoints/step_000002")
    for args, says in ((["--run", str(run), "--step", "7"], "no checkpoint step_000007"),
                       (["--run", str(tmp_path)], "no config.toml there")):
        r = primerl("eval", *args)
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.slow
def test_the_port_of_the_evaluations_server_is_its_own_from_the_pick(tmp_path):
    """Between picking a port and its server listening the model loads; a run on the same
    machine picking the same port meanwhile would answer /health in its place and have its
    model scored. The port is bound from the pick and the server is handed the socket."""
    import socket

    import httpx

    from primerl.config import ConfigSources, load_config
    from primerl.eval_command import Server

    cfg = load_config(ConfigSources(), {"model.name": "glm5", "env.name": "reverse-text",
                                        "inference.max_model_len": 256})
    server = Server(cfg, tmp_path)
    try:
        with socket.socket() as other, pytest.raises(OSError):
            other.bind((cfg.inference.host, server.port))
        deadline = time.time() + 120
        while True:
            assert server.failure() is None, server.log.read_text()
            try:
                if httpx.get(server.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline
            time.sleep(0.3)
    finally:
        server.stop()
