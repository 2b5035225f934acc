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
import tempfile
import threading
import time
from pathlib import Path

import pytest
from primerl_swe import repo, sandbox
from primerl_swe.build_tasks import build
from primerl_swe.env import Swe, SweConfig, load_tasks
from primerl_swe.records import TaskFileError
from primerl_swe.testenv import make_layered_venv

from primerl.envs import TaskError
from primerl.errors import PrimerlError

needs_bwrap = pytest.mark.skipif(sandbox.bwrap_path() is None, reason="bubblewrap is not installed")


@pytest.fixture(scope="module")
def tasks_file(tmp_path_factory):
    return build(tmp_path_factory.mktemp("swe"))


def swe(tasks, cache, **options) -> Swe:
    """The env as a run makes it, its task environments in the session's cache."""
    return Swe(SweConfig(tasks=str(tasks), cache_dir=str(cache), **options))


@pytest.fixture
def scratch(tmp_path):
    d = tmp_path / "scratch"
    d.mkdir()
    return d


def test_shipped_set_is_large_and_well_formed(tasks_file):
    recs = load_tasks(tasks_file)
    assert len(recs) >= 20 and len({r.instance_id for r in recs}) == len(recs)
    for r in recs:
        assert r.fail_to_pass and r.pass_to_pass and r.patch.startswith("diff --git")
        assert repo.git(["rev-parse", "HEAD"], r.repo).strip() == r.base_commit


def test_bad_task_files_name_the_problem(tmp_path):
    bad = tmp_path / "t.jsonl"
    bad.write_text('{"instance_id": "x"}\n')
    with pytest.raises(TaskFileError, match=r"t.jsonl:1: missing fields \['repo'"):
        load_tasks(bad)
    with pytest.raises(ValueError, match="is not a file"):
        SweConfig(tasks=str(tmp_path / "missing.jsonl"))


@needs_bwrap
@pytest.mark.slow
def test_env_check_oracle_gives_one_and_none_gives_zero(tasks_file, swe_cache):
    """`primerl env check swe`, as users run it: reward 1 with the gold patch, 0 without."""
    for flags, want in ((["--oracle"], 1.0), ([], 0.0)):
        r = subprocess.run([sys.executable, "-m", "primerl.cli", "env", "check", "swe", "--tasks", str(tasks_file),
                            "--json", "--env.cache_dir", str(swe_cache), *flags],
                           capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stdout + r.stderr
        results = json.loads(r.stdout)
        assert len(results) >= 20
        assert [x["reward"] for x in results] == [want] * len(results), results


@needs_bwrap
@pytest.mark.slow
def test_tasks_are_genuine_bugs(tasks_file, swe_cache):
    """Before the fix the regression tests fail while the existing suite passes; after it all pass."""
    env = swe(tasks_file, swe_cache)
    for rec in load_tasks(tasks_file)[:3]:
        work = repo.checkout(rec.repo, rec.base_commit)
        try:
            repo.apply_patch(work, rec.test_patch)
            report, _ = repo.run_tests(work, rec.tests, env=env.test_env(rec, work))
            assert all(report.outcomes.get(t) == "FAILED" for t in rec.fail_to_pass), report
            assert all(report.outcomes.get(t) == "PASSED" for t in rec.pass_to_pass), report
        finally:
            repo.remove(work)


def test_scratch_roots_are_per_instance_and_a_dead_owners_is_reaped(tasks_file, swe_cache):
    """Two envs in one process (tests, a pool that makes a fresh env) each own a scratch root:
    closing one leaves the other's checkouts alone. A root whose owner died (a killed worker,
    seen through a lock, not a pid that another namespace or a later process may reuse) is
    removed by the next env that makes one; a live owner's root is not."""
    first, second = swe(tasks_file, swe_cache), swe(tasks_file, swe_cache)
    rec = next(iter(first.records().values()))
    try:
        kept = second._checkout(rec)
        first._checkout(rec)
        first.close()
        assert kept.is_dir() and second._checkout(rec).is_dir()  # second's root survived first's close
        code = ("import os, sys; from primerl_swe.env import Swe, SweConfig; "
                "env = Swe(SweConfig(tasks=sys.argv[1], cache_dir=sys.argv[2])); "
                "print(env._scratch_root(), flush=True); os._exit(0)")  # dies without close()
        r = subprocess.run([sys.executable, "-c", code, str(tasks_file), str(swe_cache)],
                           capture_output=True, text=True, timeout=120, check=True)
        dead = Path(r.stdout.strip())
        assert dead.is_dir()
        third = swe(tasks_file, swe_cache)
        third._scratch_root()
        assert not dead.exists() and second.root.is_dir()  # the dead owner's reaped, the live one's kept
        third.close()
    finally:
        second.close()
    assert not kept.exists()


@needs_bwrap
@pytest.mark.slow
def test_agent_tools_work_and_stay_inside_the_checkout(tasks_file, swe_cache):
    env = swe(tasks_file, swe_cache)
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
    sandbox.run(":(){ :|:& };:", scratch, limits=sandbox.Limits(wall_s=5, processes=32))
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
    with pytest.raises(PrimerlError, match="apt-get install bubblewrap.*--env.sandbox rlimit"):
        sandbox.resolve("auto")
    assert sandbox.resolve("rlimit") == "rlimit"


def test_env_check_without_bubblewrap_prints_one_line_and_exits_2(tasks_file, tmp_path):
    """bwrap not on PATH (nor anything else): one line naming the fix, no traceback, exit 2."""
    empty = tmp_path / "bin"
    empty.mkdir()
    r = subprocess.run([sys.executable, "-m", "primerl.cli", "env", "check", "swe", "--tasks", str(tasks_file),
                        "--oracle", "--json"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PATH": str(empty), "COLUMNS": "400"})
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("error:") and "apt-get install bubblewrap" in line and "--env.sandbox rlimit" in line


# -- harness failures are errors with their cause; the model's failures stay 0 -----------------

GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@example.invalid"}


def _git(args, cwd):
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True,
                          env={**os.environ, **GIT_ENV}).stdout


def _unseen_tasks(root: Path) -> Path:
    """A SWE-bench-format task file over a repository made here (not the shipped set): one
    good task, and tasks broken in each way a dataset can be."""
    src = root / "calc"
    files = {
        "calc/__init__.py": "",
        "calc/ops.py": "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n",
        "tests/__init__.py": "",
        "tests/test_ops.py": ("from calc.ops import mul\n\n\ndef test_mul():\n    assert mul(2, 3) == 6\n\n\n"
                              "def test_needs_a_service():\n    import os\n"
                              "    assert os.path.exists('/run/primerl-no-such-service')\n"),
    }
    for path, text in files.items():
        (src / path).parent.mkdir(parents=True, exist_ok=True)
        (src / path).write_text(text)
    _git(["init", "--quiet"], src)
    _git(["add", "-A"], src)
    _git(["commit", "--quiet", "-m", "calc"], src)
    base = _git(["rev-parse", "HEAD"], src).strip()
    (src / "calc/ops.py").write_text(files["calc/ops.py"].replace("a - b", "a + b"))
    patch = _git(["diff"], src)
    _git(["checkout", "--quiet", "--", "calc/ops.py"], src)
    (src / "tests/test_add.py").write_text("from calc.ops import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n")
    _git(["add", "-N", "tests/test_add.py"], src)
    test_patch = _git(["diff"], src)
    _git(["rm", "--quiet", "--cached", "tests/test_add.py"], src)
    (src / "tests/test_add.py").unlink()
    good = {"instance_id": "calc__add", "repo": "calc", "base_commit": base, "problem_statement": "add subtracts",
            "patch": patch, "test_patch": test_patch, "FAIL_TO_PASS": json.dumps(["tests/test_add.py::test_add"]),
            "PASS_TO_PASS": json.dumps(["tests/test_ops.py::test_mul"])}
    recs = [
        good,
        {**good, "instance_id": "calc__p2p-fails-at-base",
         "PASS_TO_PASS": ["tests/test_ops.py::test_mul", "tests/test_ops.py::test_needs_a_service"]},
        {**good, "instance_id": "calc__test-patch-does-not-apply",
         "test_patch": test_patch.replace("tests/test_add.py", "tests/test_ops.py").replace("new file mode 100644\n", "")},
        {**good, "instance_id": "calc__bad-commit", "base_commit": "1" * 40},
        {**good, "instance_id": "calc__no-repo", "repo": "missing"},
        {**good, "instance_id": "calc__no-fail-to-pass", "FAIL_TO_PASS": []},
    ]
    path = root / "tasks.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


BROKEN = {"calc__p2p-fails-at-base": "PASS_TO_PASS tests do not pass on base_commit .* with test_patch applied: "
                                      r"tests/test_ops.py::test_needs_a_service \(FAILED\)",
          "calc__test-patch-does-not-apply": "test_patch does not apply to base_commit",
          "calc__bad-commit": "repository or base_commit unusable",
          "calc__no-repo": "repository or base_commit unusable: .*missing is not a git repository",
          "calc__no-fail-to-pass": "no FAIL_TO_PASS tests"}


@pytest.fixture(scope="module")
def unseen(tmp_path_factory):
    return _unseen_tasks(tmp_path_factory.mktemp("unseen"))


@needs_bwrap
@pytest.mark.slow
def test_unseen_tasks_check_like_the_shipped_ones_and_broken_ones_are_errors(unseen, swe_cache):
    import re

    env = swe(unseen, swe_cache)
    for oracle, want in ((True, 1.0), (False, 0.0)):
        rows = {r["instance_id"]: r for r in env.check(oracle=oracle)}
        assert rows["calc__add"]["reward"] == want and rows["calc__add"]["error"] is None, rows["calc__add"]
        for iid, cause in BROKEN.items():
            assert rows[iid]["reward"] is None and re.search(cause, rows[iid]["error"]), (oracle, rows[iid])
    # an episode of a broken task, as the orchestrator runs it: the reward is an error, not 0
    task = next(t for t in env.tasks("train") if t.id == "calc__p2p-fails-at-base")
    state = env.setup(task)
    try:
        with pytest.raises(TaskError, match=BROKEN[task.id]) as err:
            env.reward(task, state)
        assert err.value.task_id == task.id
    finally:
        env.cleanup(task, state)
    with pytest.raises(TaskError, match=BROKEN["calc__no-repo"]):
        env.setup(next(t for t in env.tasks("train") if t.id == "calc__no-repo"))


@needs_bwrap
@pytest.mark.slow
def test_model_caused_failures_stay_zero(unseen, tmp_path, swe_cache):
    """Whatever the agent does to its checkout is a reward of 0, never an error: a syntax error,
    a conftest that kills pytest, a wrecked or hostile .git, a chmod-ed checkout, a symlink out."""
    env = swe(unseen, swe_cache)
    task = next(t for t in env.tasks("train") if t.id == "calc__add")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "test_add.py").write_text("keep me")
    marker = tmp_path / "host-code-ran"
    # a complete repository in .git (a copy of the read-only one) whose config runs a program
    hostile_git = (f"g=$(sed 's/^gitdir: //' .git) && rm .git && cp -r \"$g\" .git && chmod -R u+w .git && "
                   f"printf '[core]\\n\\tfsmonitor = \"touch {marker}; false\"\\n' >> .git/config && git status")
    sabotage = {
        "syntax error": ("write_file", {"path": "calc/ops.py", "content": "def add(a, b)\n    return a + b\n"}),
        "conftest exits": ("write_file", {"path": "conftest.py", "content": "import os\nos._exit(3)\n"}),
        "test file removed": ("run", {"command": "rm -rf tests"}),
        "hostile .git": ("run", {"command": hostile_git}),
        "checkout chmod 000": ("run", {"command": "chmod 000 ."}),
        "tests/ is a symlink out": ("run", {"command": f"rm -rf tests && ln -s {outside} tests"}),
    }
    for what, (tool, args) in sabotage.items():
        state = env.setup(task)
        try:
            getattr(env, tool)(state, **args)
            assert env.reward(task, state) == 0.0, what
        finally:
            env.cleanup(task, state)
    assert not marker.exists()  # host git never read the model's configuration
    assert (outside / "test_add.py").read_text() == "keep me"  # nor followed its symlink


@needs_bwrap
@pytest.mark.slow
def test_the_run_tool_finds_python_pytest_and_git(unseen, swe_cache):
    """`python`, `pytest` and `pip` are the task environment's (the checkout installed in it), git reads."""
    env = swe(unseen, swe_cache)
    task = next(t for t in env.tasks("train") if t.id == "calc__add")
    state = env.setup(task)
    try:
        out = env.run(state, "python -c 'import sys, calc; print(sys.prefix, calc.__file__)' && pytest --version && "
                             "pip --version && "
                             "echo '# note' >> calc/ops.py && git diff --stat && git commit -qam y; echo committed=$?")
        assert out.startswith("[exit code 0]") and f"{state['env']} /tmp/testbed/calc/__init__.py" in out, out
        assert "pytest" in out and "\npip " in out, out
        assert "calc/ops.py" in out and "committed=0" not in out  # git reads, the git directory is read-only
        assert "passed" in env.run_tests(state, "tests/test_ops.py::test_mul")
    finally:
        env.cleanup(task, state)


def _venv(layered: bool) -> Path:
    """A virtual environment under /tmp (hidden by the sandbox's private /tmp unless bound):
    layered over this interpreter's site directories (it sees primerl and pytest), or bare."""
    d = Path(tempfile.mkdtemp(prefix="primerl-venv-", dir="/tmp"))
    if layered:
        make_layered_venv(d)
    else:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(d)], check=True)
    return d


@needs_bwrap
@pytest.mark.slow
def test_an_interpreter_under_tmp_runs_the_tests(unseen, swe_cache):
    """The interpreter running primerl lives in a venv under /tmp: the sandbox binds it after its
    private /tmp, so the tests run (reward 1 with the gold patch) and `python` is that venv's."""
    venv = _venv(layered=True)
    try:
        code = ("import json, sys; from pathlib import Path; from primerl_swe import sandbox; "
                "from primerl_swe.env import Swe, SweConfig; "
                "r = sandbox.run(\"python -c 'import sys; print(sys.prefix)'\", Path(sys.argv[2])); "
                "env = Swe(SweConfig(tasks=sys.argv[1], cache_dir=sys.argv[3])); "
                "print(json.dumps([r.output.strip(), env.check(oracle=True)]))")
        scratch = Path(tempfile.mkdtemp(prefix="primerl-scratch-"))
        r = subprocess.run([str(venv / "bin" / "python"), "-c", code, str(unseen), str(scratch), str(swe_cache)],
                           capture_output=True, text=True, timeout=300)
        shutil.rmtree(scratch, ignore_errors=True)
        assert r.returncode == 0, r.stdout + r.stderr
        prefix, rows = json.loads(r.stdout)
        assert prefix == str(venv)
        assert {x["instance_id"]: x["reward"] for x in rows}["calc__add"] == 1.0, rows
    finally:
        shutil.rmtree(venv, ignore_errors=True)


@needs_bwrap
@pytest.mark.slow
def test_pytest_missing_in_the_interpreter_is_a_task_error(unseen, tmp_path):
    """primerl runs from an interpreter without pytest (its packages come from a site dir the
    sandbox's clean environment does not see): every task is an error naming the fix."""
    import sysconfig

    venv = _venv(layered=False)
    try:
        one = tmp_path / "one.jsonl"
        one.write_text(unseen.read_text().splitlines()[0] + "\n")
        (tmp_path / "calc").symlink_to(unseen.parent / "calc")
        code = ("import json, site, sys; site.addsitedir(sys.argv[2]); "
                "from primerl.envs import TaskError; from primerl_swe.env import Swe, SweConfig; "
                "env = Swe(SweConfig(tasks=sys.argv[1], cache_dir=sys.argv[3])); rows = env.check(oracle=True); "
                "env.check(oracle=False) == rows or print('differs'); print(json.dumps(rows))")
        r = subprocess.run([str(venv / "bin" / "python"), "-c", code, str(one), sysconfig.get_paths()["purelib"],
                            str(tmp_path / "cache")], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        (row,) = json.loads(r.stdout.splitlines()[-1])
        assert row["reward"] is None and f"pytest is not installed in {venv}/bin/python" in row["error"], row
        assert "pip install pytest" in row["error"]
    finally:
        shutil.rmtree(venv, ignore_errors=True)


@needs_bwrap
def test_a_sandbox_that_cannot_start_is_an_error_not_a_result(scratch, tmp_path):
    with pytest.raises(sandbox.SandboxError, match="bwrap: Can't find source path"):
        sandbox.run("true", scratch, ro_paths=[str(tmp_path / "missing")])
    r = sandbox.run("echo bwrap: pretend; exit 1", scratch)  # the command's own output is a result
    assert r.returncode == 1 and r.output == "bwrap: pretend\n"
