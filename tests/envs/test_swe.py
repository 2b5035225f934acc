"""The swe environment: the shipped task set, the harness rule, tools, and the sandbox.

The sandbox tests try each escape a model-written program might attempt and check that
the host is untouched. They need bubblewrap (`.ci/run` installs it).
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from primerl_swe import repo, sandbox
from primerl_swe.build_tasks import build
from primerl_swe.env import Swe, SweConfig, load_tasks

needs_bwrap = pytest.mark.skipif(sandbox.bwrap_path() is None, reason="bubblewrap is not installed")


@pytest.fixture(scope="module")
def tasks_file(tmp_path_factory):
    return build(tmp_path_factory.mktemp("swe"))


@pytest.fixture
def scratch(tmp_path):
    d = tmp_path / "scratch"
    d.mkdir()
    return d


def test_shipped_set_is_large_and_well_formed(tasks_file):
    recs = load_tasks(tasks_file)
    assert len(recs) >= 20 and len({r["instance_id"] for r in recs}) == len(recs)
    for r in recs:
        assert r["FAIL_TO_PASS"] and r["PASS_TO_PASS"] and r["patch"].startswith("diff --git")
        assert repo.git(["rev-parse", "HEAD"], Path(r["repo"])).strip() == r["base_commit"]


def test_bad_task_files_name_the_problem(tmp_path):
    bad = tmp_path / "t.jsonl"
    bad.write_text('{"instance_id": "x"}\n')
    with pytest.raises(ValueError, match=r"t.jsonl:1: missing fields \['repo'"):
        load_tasks(bad)
    with pytest.raises(ValueError, match="is not a file"):
        SweConfig(tasks=str(tmp_path / "missing.jsonl"))


@needs_bwrap
@pytest.mark.slow
def test_env_check_oracle_gives_one_and_none_gives_zero(tasks_file):
    """`primerl env check swe`, as users run it: reward 1 with the gold patch, 0 without."""
    for flags, want in ((["--oracle"], 1.0), ([], 0.0)):
        r = subprocess.run([sys.executable, "-m", "primerl.cli", "env", "check", "swe", "--tasks", str(tasks_file),
                            "--json", *flags], capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stdout + r.stderr
        results = json.loads(r.stdout)
        assert len(results) >= 20
        assert [x["reward"] for x in results] == [want] * len(results), results


@needs_bwrap
def test_tasks_are_genuine_bugs(tasks_file):
    """Before the fix the regression tests fail while the existing suite passes; after it all pass."""
    for rec in load_tasks(tasks_file)[:3]:
        work = repo.checkout(rec["repo"], rec["base_commit"])
        try:
            repo.apply_patch(work, rec["test_patch"])
            outcomes, _ = repo.run_tests(work, rec["FAIL_TO_PASS"] + rec["PASS_TO_PASS"])
            assert all(outcomes.get(t) == "FAILED" for t in rec["FAIL_TO_PASS"]), outcomes
            assert all(outcomes.get(t) == "PASSED" for t in rec["PASS_TO_PASS"]), outcomes
        finally:
            repo.remove(work)


@needs_bwrap
def test_agent_tools_work_and_stay_inside_the_checkout(tasks_file, tmp_path):
    env = Swe(SweConfig(tasks=str(tasks_file)))
    task = next(t for t in env.tasks("train") if t.id == "pyutils__median-even")
    state = env.setup(task)
    try:
        assert "pyutils/maths.py" in env.list_files(state)
        assert "def median" in env.read_file(state, "pyutils/maths.py")
        assert "pyutils/maths.py:" in env.search(state, r"return s\[mid\]$")
        with pytest.raises(PermissionError):
            env.read_file(state, "../../../../etc/passwd")
        os.symlink("/etc/passwd", Path(state["workdir"]) / "leak")
        with pytest.raises(PermissionError):
            env.read_file(state, "leak")
        assert env.reward(task, state) == 0.0
        missing = '<tool_call>{"name": "replace", "arguments": {"path": "pyutils/maths.py", "old": "nope", "new": "x"}}</tool_call>'
        assert "occurs 0 times" in env.step(task, state, missing).messages[0]["content"]
        fix = ('<tool_call>{"name": "replace", "arguments": {"path": "pyutils/maths.py", '
               '"old": "        return s[mid]\\n    return s[mid]", '
               '"new": "        return s[mid]\\n    return (s[mid - 1] + s[mid]) / 2"}}</tool_call>')
        assert env.step(task, state, fix).messages[0]["content"] == "edited pyutils/maths.py"
        assert "passed" in env.run_tests(state)
        turn = env.step(task, state, '<tool_call>{"name": "submit", "arguments": {}}</tool_call>')
        assert turn.done and env.reward(task, state) == 1.0
    finally:
        env.cleanup(task, state)
    assert not Path(state["workdir"]).exists()


# -- sandbox escapes -------------------------------------------------------------------------


@needs_bwrap
def test_sandbox_cannot_write_outside_the_checkout(scratch, tmp_path):
    target = tmp_path / "outside.txt"
    r = sandbox.run(f"echo inside > ok.txt; echo x > {target}; echo x > /etc/primerl-escape; "
                    f"echo x > $HOME/escape; echo x > /tmp/escape; cat ok.txt", scratch)
    assert (scratch / "ok.txt").read_text() == "inside\n" and "inside" in r.output
    assert not target.exists() and not Path("/etc/primerl-escape").exists()
    assert not Path("/tmp/escape").exists()  # the sandbox's /tmp is its own


@needs_bwrap
def test_sandbox_has_no_network(scratch):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    accepted = []
    threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True).start()
    r = sandbox.run(f"{sys.executable} -c \"import socket; socket.create_connection(('127.0.0.1', {port}), 3); "
                    f"print('CONNECTED')\"", scratch)
    time.sleep(0.2)
    server.close()
    assert "CONNECTED" not in r.output and not accepted and r.returncode != 0


@needs_bwrap
def test_sandbox_survives_a_fork_bomb(scratch):
    before = len(os.listdir("/proc"))
    t0 = time.monotonic()
    r = sandbox.run(":(){ :|:& };:", scratch, limits=sandbox.Limits(wall_s=5, processes=32))
    assert time.monotonic() - t0 < 30
    time.sleep(0.5)
    assert len(os.listdir("/proc")) < before + 10  # nothing of it is left on the host
    assert subprocess.run(["true"]).returncode == 0  # the host can still start processes


@needs_bwrap
def test_sandbox_limits_memory(scratch):
    r = sandbox.run(f"{sys.executable} -c \"x = bytearray(4 << 30); print('ALLOCATED')\"", scratch,
                    limits=sandbox.Limits(memory_mb=512))
    assert "ALLOCATED" not in r.output and "MemoryError" in r.output


@needs_bwrap
def test_sandbox_kills_infinite_loops(scratch):
    t0 = time.monotonic()
    r = sandbox.run(f"{sys.executable} -c 'while True: pass' & sleep 1000", scratch,
                    limits=sandbox.Limits(wall_s=2))
    assert r.timed_out and time.monotonic() - t0 < 15
    time.sleep(0.5)
    leftovers = subprocess.run(["pgrep", "-f", "while True: pass"], capture_output=True, text=True).stdout.split()
    assert leftovers == []
    r = sandbox.run(f"{sys.executable} -c 'while True: pass'", scratch, limits=sandbox.Limits(cpu_s=1, wall_s=30))
    assert r.returncode != 0 and not r.timed_out  # RLIMIT_CPU stops it first


def test_missing_bubblewrap_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="apt-get install bubblewrap.*--env.sandbox rlimit"):
        sandbox.resolve("auto")
    assert sandbox.resolve("rlimit") == "rlimit"
