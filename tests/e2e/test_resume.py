"""Checkpoint and resume, as a user (or a Slurm requeue) does it: real processes killed, the
same ``primerl run`` command again into the same output directory."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_run import SMALL, alive, descendants

from primerl.config import tomllib
from primerl.rundir import RunDir
from primerl.samples import read_batch

pytestmark = pytest.mark.slow

# synchronous (async_level 0): every batch is exactly the groups drawn for it, so two runs
# of one config draw the same tasks into the same batches and the comparison is exact
FLAGS = ["--model", "glm5", "--env", "reverse-text", *SMALL, "--orchestrator.async_level", "0",
         "--trainer.checkpoint_every", "2"]


def command(out: Path, max_steps: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "primerl.cli", "run", *FLAGS, "--max-steps", str(max_steps),
            "--output-dir", str(out), *extra]


def run(out: Path, max_steps: int, *extra: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(command(out, max_steps, *extra), capture_output=True, text=True, timeout=timeout)


def steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


def start_and_wait(out: Path, max_steps: int, after_step: int) -> tuple[subprocess.Popen, set[int]]:
    """Start a run; return once metrics.jsonl has ``after_step`` lines, with every process below it."""
    proc = subprocess.Popen(command(out, max_steps), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 400
    kids: set[int] = set()
    while len(steps(out)) < after_step:
        kids |= descendants(proc.pid)
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "the run made no progress"
        time.sleep(0.1)
    return proc, kids | descendants(proc.pid)


def kill_everything(proc: subprocess.Popen, kids: set[int]) -> None:
    """SIGKILL the launcher and every process below it at once: a node lost mid-step."""
    for pid in [proc.pid, *kids]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.communicate(timeout=30)
    deadline = time.time() + 10
    while [k for k in kids if alive(k)] and time.time() < deadline:
        time.sleep(0.1)
    assert [k for k in kids if alive(k)] == []


def task_ids(out: Path, n: int) -> list[str]:
    return sorted(s.task_id for s in read_batch(RunDir(out).batch(n)).samples)


def listing(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    r = run(out, 12)
    assert r.returncode == 0, r.stdout + r.stderr
    return out


def test_a_killed_run_resumes_every_step_once_in_the_same_task_order(uninterrupted, tmp_path):
    out = tmp_path / "run"
    proc, kids = start_and_wait(out, 12, after_step=5)
    kill_everything(proc, kids)
    done = steps(out)
    assert done[:5] == [1, 2, 3, 4, 5] and len(done) < 12
    ckpt = RunDir(out).checkpoint_steps()[-1]
    assert ckpt >= 4

    # another config for that directory is refused, one line, and touches nothing
    before = listing(out)
    lr = tomllib.loads((out / "config.toml").read_text())["trainer"]["lr"]
    other = run(out, 12, "--trainer.lr", "3e-5", timeout=120)
    assert other.returncode == 2, other.stdout + other.stderr
    (error,) = [line for line in other.stderr.splitlines() if line.startswith("error:")]
    assert "holds an unfinished run" in error and f"trainer.lr {lr!r} -> 3e-05" in error, other.stderr
    assert "--overwrite" in error
    assert listing(out) == before

    # the same command continues: every step once, the same tasks in every batch
    again = run(out, 12)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"from checkpoints/step_{ckpt:06d}" in again.stdout
    assert steps(out) == list(range(1, 13))
    for n in range(1, 13):
        assert task_ids(out, n) == task_ids(uninterrupted, n), f"batch {n}"
    trainer_log = (out / "logs" / "trainer.log").read_text()
    assert f"resumed from {RunDir(out).checkpoint(ckpt)} (step {ckpt})" in trainer_log
    orchestrator_log = (out / "logs" / "orchestrator.log").read_text()
    assert f"resuming after batch {ckpt}" in orchestrator_log and "batch 1:" not in orchestrator_log
    # the killed attempt's logs and the steps it did past the checkpoint are kept aside
    (previous,) = out.glob("previous-*")
    assert (previous / "logs" / "trainer.log").is_file()
    assert [json.loads(x)["step"] for x in (previous / "metrics.jsonl").read_text().splitlines()] == done
    assert len(RunDir(out).checkpoint_steps()) == 3  # keep_checkpoints: the newest three


def test_a_trainer_crash_stops_the_run_and_the_same_command_continues_past_a_damaged_checkpoint(tmp_path):
    out = tmp_path / "run"
    proc, _ = start_and_wait(out, 8, after_step=5)
    trainer = [k for k in descendants(proc.pid)
               if "primerl.cli trainer" in Path(f"/proc/{k}/cmdline").read_bytes().replace(b"\0", b" ").decode()]
    assert trainer
    os.kill(trainer[0], signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert "the trainer process exited with code -9; stopped the others" in err
    run_dir = RunDir(out)
    newest = run_dir.checkpoint_steps()[-1]
    # damage the newest checkpoint: a truncated weights file
    weights = run_dir.checkpoint(newest) / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    again = run(out, 8)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"checkpoints/step_{newest:06d} is unusable (model.safetensors has 1000 bytes" in again.stdout
    assert f"from checkpoints/step_{newest - 2:06d}" in again.stdout
    assert steps(out) == list(range(1, 9))
    (previous,) = out.glob("previous-*")
    assert (previous / "checkpoints" / f"step_{newest:06d}").is_dir()  # set aside, not deleted


def test_a_rerun_without_a_checkpoint_starts_over_keeping_the_earlier_files(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(command(out, 6, "--trainer.checkpoint_every", "6"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 400
    kids: set[int] = set()
    while len(steps(out)) < 1:
        kids |= descendants(proc.pid)
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.1)
    kill_everything(proc, kids | descendants(proc.pid))
    assert RunDir(out).checkpoint_steps() == []
    earlier = steps(out)
    again = run(out, 2, "--trainer.checkpoint_every", "6")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "no usable checkpoint: starting over" in again.stdout
    assert steps(out) == [1, 2]
    (previous,) = out.glob("previous-*")
    assert [json.loads(x)["step"] for x in (previous / "metrics.jsonl").read_text().splitlines()] == earlier
    for kept in ("rollouts/step_000001.pt", "weights/step_000000/STABLE", "logs/trainer.log", "config.toml"):
        assert (previous / kept).exists(), kept
    # and --overwrite starts afresh from a finished run, keeping it aside too
    fresh = run(out, 2, "--trainer.checkpoint_every", "6", "--overwrite")
    assert fresh.returncode == 0, fresh.stdout + fresh.stderr
    assert len(list(out.glob("previous-*"))) == 2 and steps(out) == [1, 2]
