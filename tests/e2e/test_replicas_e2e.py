"""`primerl run` with two inference replicas, one SIGKILLed mid-run: the run still finishes,
and the launcher starts the lost server again (inference.max_restarts)."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SMALL = ["--sft.steps", "0", "--orchestrator.batch_size", "8", "--orchestrator.group_size", "4",
         "--orchestrator.max_tokens", "8", "--trainer.seq_len", "256"]


def pid_serving(port: int) -> int | None:
    """The ``primerl inference`` process started with ``--inference.port port`` (from /proc)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "inference" in args and "--inference.port" in args and str(port) in args:
            return int(entry.name)
    return None


def test_a_run_survives_losing_one_of_two_inference_servers(tmp_path):
    """With restarts off the lost server stays down and the run finishes on the other."""
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "primerl.cli", "run", "--model", "glm5", "--env", "reverse-text",
                             "--inference.replicas", "2", "--inference.max_restarts", "0", "--max-steps", "6",
                             "--output-dir", str(out), *SMALL],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed: dict[str, int] = {}

    def kill_one_after_step_2():
        deadline = time.time() + 600
        while time.time() < deadline and proc.poll() is None:
            metrics = out / "metrics.jsonl"
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
                urls = json.loads((out / "runtime.json").read_text())["inference_urls"]
                pid = pid_serving(int(urls[1].rsplit(":", 1)[1]))
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    killed["pid"] = pid
                return
            time.sleep(0.2)

    killer = threading.Thread(target=kill_one_after_step_2, daemon=True)
    killer.start()
    try:
        stdout, stderr = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    killer.join(timeout=5)
    assert "pid" in killed, "the second inference server was never found to kill"
    assert proc.returncode == 0, stdout + stderr
    assert "the inference-1 process exited with code -9" in stdout and "the run goes on" in stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert rows[0]["inference/servers_up"] == 2
    assert any(r["inference/resent"] > 0 for r in rows) or any(r["inference/servers_up"] == 1 for r in rows)
    assert rows[-1]["inference/servers_up"] == 1
    assert (out / "logs" / "inference-0.log").exists() and (out / "logs" / "inference-1.log").exists()
    assert "ejected from routing" in (out / "logs" / "orchestrator.log").read_text()


def test_a_lost_server_is_started_again_and_readmitted_with_the_current_weights(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "primerl.cli", "run", "--model", "glm5", "--env", "reverse-text",
                             "--inference.replicas", "2", "--max-steps", "1000", "--output-dir", str(out), *SMALL],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics, orchestrator_log = out / "metrics.jsonl", out / "logs" / "orchestrator.log"

    def rows() -> list[dict]:
        return [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []

    try:
        deadline = time.time() + 300
        while len(rows()) < 2:
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.2)
        url = json.loads((out / "runtime.json").read_text())["inference_urls"][1]
        os.kill(pid_serving(int(url.rsplit(":", 1)[1])), signal.SIGKILL)
        killed_at = len(rows())
        back = f"inference server {url} answers /health: back in routing with policy v"
        # readmitted, and a later step trained with both servers up again
        while not (back in orchestrator_log.read_text() and rows()[-1]["inference/servers_up"] == 2
                   and len(rows()) > killed_at + 1):
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    said = " ".join(stdout.split())  # the live view wraps long lines
    assert "the inference-1 process exited with code -9; restarting it (1 of at most 3)" in said, stdout + stderr
    assert proc.returncode == 130, stdout + stderr
    assert f"inference server {url} ejected from routing" in orchestrator_log.read_text()
    steps = [r["step"] for r in rows()]
    assert steps == list(range(1, len(steps) + 1))  # nothing lost or trained twice meanwhile


def test_losing_every_inference_server_stops_the_run_with_the_cause(tmp_path):
    """Both servers lost at once: nothing is left to serve while one restarts, so the run
    stops (restarts off: the two kills must not straddle a check of the launcher's)."""
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "primerl.cli", "run", "--model", "glm5", "--env", "reverse-text",
                             "--inference.replicas", "2", "--inference.max_restarts", "0", "--max-steps", "1000",
                             "--output-dir", str(out), *SMALL],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().strip()):
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.2)
        for url in json.loads((out / "runtime.json").read_text())["inference_urls"]:
            os.kill(pid_serving(int(url.rsplit(":", 1)[1])), signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1, stdout + stderr
    (cause,) = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert "every inference process exited" in cause and "stopped the others" in cause
