"""A stuck run says where it is stuck: faults made for real (a stopped inference server, a
stopped trainer, an env call that never returns), each ending the run with one line naming
the stuck stage, every process's waits and stacks in logs/watchdog.log."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

STALL_S = 10
SMALL = ["--sft.steps", "0", "--orchestrator.batch_size", "8", "--orchestrator.group_size", "4",
         "--orchestrator.max_tokens", "8", "--trainer.seq_len", "256"]
STUCK_PLUGIN = Path(__file__).parent / "stuck_plugin"


def start_run(out: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "primerl.cli", "run", "--model", "glm5", "--output-dir", str(out), *SMALL,
           "--watchdog.stall_timeout_s", str(STALL_S), *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})


def wait_for_steps(out: Path, proc: subprocess.Popen, n: int, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    metrics = out / "metrics.jsonl"
    while time.time() < deadline:
        assert proc.poll() is None, proc.communicate()
        if metrics.exists() and len(metrics.read_text().splitlines()) >= n:
            return
        time.sleep(0.5)
    raise AssertionError(f"no {n} steps in {timeout} s")


def beacon_pid(out: Path, role_prefix: str) -> int:
    for path in (out / "progress").glob("*.json"):
        record = json.loads(path.read_text())
        if record["role"].startswith(role_prefix):
            return record["pid"]
    raise AssertionError(f"no beacon of {role_prefix}")


def ends_stalled(proc: subprocess.Popen, t_fault: float) -> str:
    """The run's last stderr line, once it exited with the watchdog's code in time."""
    _, err = proc.communicate(timeout=STALL_S + 30 + 15)  # + the launcher's grace period to stop children
    assert proc.returncode == 3, err[-3000:]
    line = err.strip().splitlines()[-1]
    assert time.time() - t_fault < STALL_S + 30 + 15
    assert line.startswith(f"error: the run made no progress for {STALL_S} s: "), line
    return line


def test_a_stopped_inference_server_is_named(tmp_path):
    out = tmp_path / "run"
    proc = start_run(out, "--env", "reverse-text", "--max-steps", "1000")
    wait_for_steps(out, proc, 2)
    pid = beacon_pid(out, "inference")
    os.kill(pid, signal.SIGSTOP)
    try:
        line = ends_stalled(proc, time.time())
    finally:
        if Path(f"/proc/{pid}").exists():
            os.kill(pid, signal.SIGCONT)
    assert "inference not answering: the inference process" in line and "is stopped" in line, line
    report = (out / "logs" / "watchdog.log").read_text()
    # the orchestrator waits on the stopped server: a request, or the weight update of a step's end
    assert "== orchestrator" in report and re.search(r"waiting on (inference|weights): ", report), report[-3000:]
    assert "stacks written to orchestrator.log" in report and "Thread 0x" in report  # faulthandler's dump


def test_a_stopped_trainer_is_named(tmp_path):
    out = tmp_path / "run"
    proc = start_run(out, "--env", "reverse-text", "--max-steps", "1000")
    wait_for_steps(out, proc, 2)
    pid = beacon_pid(out, "trainer")
    os.kill(pid, signal.SIGSTOP)
    line = ends_stalled(proc, time.time())
    assert "the trainer process" in line and "is stopped" in line, line
    report = (out / "logs" / "watchdog.log").read_text()
    assert "== trainer" in report and "stacks written to inference.log" in report


def test_an_env_call_that_never_returns_is_named(tmp_path):
    out = tmp_path / "run"
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(STUCK_PLUGIN), os.environ.get("PYTHONPATH")]))}
    t0 = time.time()
    proc = start_run(out, "--env", "never-answers", "--max-steps", "5", env=env)
    line = ends_stalled(proc, t0 + 60)  # the servers start first (up to a minute here)
    assert "an env worker inside a call: never-answers.step of task stuck-" in line, line
    report = (out / "logs" / "watchdog.log").read_text()
    assert "waiting on env: never-answers.step" in report
    assert "time.sleep(3600)" in report or "in respond" in report  # the worker's own stack, from its log


def test_evaluations_in_flight_at_max_steps_do_not_hold_the_run(tmp_path):
    out = tmp_path / "run"
    proc = start_run(out, "--env", "reverse-text", "--max-steps", "4", "--orchestrator.eval_every", "1",
                     "--orchestrator.eval_tasks", "64")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 4
