"""The ``swe`` environment: fix a bug in a real repository with tools, judged by its tests.

Tasks come from a SWE-bench-format JSONL (``--env.tasks FILE``; ``repo`` is a local git
repository, relative paths are relative to the file). Each episode gets a scratch
checkout of ``base_commit``; the agent inspects and edits it with file tools (checked to
stay inside the checkout, symlinks included) and runs commands and tests in the sandbox
(:mod:`primerl_swe.sandbox`). When the agent submits or runs out of turns, the files that
``test_patch`` touches are reset to ``base_commit``, ``test_patch`` is applied, and the
reward is 1 if every FAIL_TO_PASS and PASS_TO_PASS test passes, else 0 — the SWE-bench
harness's rule.

``primerl env check swe --tasks FILE [--oracle] [--json]`` validates a dataset the same
way: with ``--oracle`` the gold ``patch`` is applied first, without it nothing is.

Harness failures are errors, never rewards. A task whose tests cannot run — the sandbox
does not start, the interpreter running primerl lacks pytest, ``test_patch`` does not
apply to ``base_commit``, the repository or commit is unusable, a PASS_TO_PASS test does
not pass on the clean ``base_commit`` with ``test_patch`` applied — raises
:class:`primerl.envs.TaskError` with the cause. Failures the model caused (its edit breaks
collection, its tests fail, it broke its checkout) stay reward 0. They are told apart by
reproducing: a run that is not a plain "the harness ran and only FAIL_TO_PASS tests
failed" is checked against a probe of the harness and a run of the task's own tests on a
clean checkout — both cached per process, so the cost is paid once per task at most, and
only when an episode fails.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs

from primerl.envs import Task, TaskError
from primerl.envs.multiturn import MultiTurnConfig, ToolEnv
from primerl_swe import repo, sandbox

FIELDS = ("instance_id", "repo", "base_commit", "problem_statement", "patch", "test_patch", "FAIL_TO_PASS",
          "PASS_TO_PASS")


def _check_tasks(_inst: Any, attribute: attrs.Attribute, value: str | None) -> None:
    if value is not None and not Path(value).is_file():
        raise ValueError(f"{attribute.name}: {value!r} is not a file; build the shipped set with "
                         "`python -m primerl_swe.build_tasks --out DIR` and pass DIR/tasks.jsonl")


@attrs.define(kw_only=True)
class SweConfig(MultiTurnConfig):
    tasks: str | None = attrs.field(default=None, validator=_check_tasks)  # SWE-bench-format JSONL
    sandbox: str = attrs.field(default="auto", validator=attrs.validators.in_(("auto", "bwrap", "rlimit")))
    command_timeout_s: float = attrs.field(default=30.0, validator=attrs.validators.gt(0))
    test_timeout_s: float = attrs.field(default=120.0, validator=attrs.validators.gt(0))
    memory_mb: int = attrs.field(default=2048, validator=attrs.validators.ge(64))
    max_turns: int = attrs.field(default=20, validator=attrs.validators.ge(1))
    turn_timeout_s: float = attrs.field(default=180.0, validator=attrs.validators.gt(0))


def load_tasks(path: str | Path) -> list[dict[str, Any]]:
    """Records of a SWE-bench-format JSONL, validated (errors name the line and the field)."""
    path = Path(path)
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
        missing = [f for f in FIELDS if f not in rec]
        if missing:
            raise ValueError(f"{path}:{n}: missing fields {missing}; a task needs {', '.join(FIELDS)}")
        for f in ("FAIL_TO_PASS", "PASS_TO_PASS"):
            if isinstance(rec[f], str):  # SWE-bench ships these as JSON strings
                rec[f] = json.loads(rec[f])
        rec["repo"] = str((path.parent / rec["repo"]).resolve())
        out.append(rec)
    if not out:
        raise ValueError(f"{path} holds no tasks")
    return out


class Swe(ToolEnv):
    Config = SweConfig
    system_prompt = ("You fix a bug in the repository in your working directory. Inspect the code, edit it, "
                     "run the tests, then call submit.")
    tools = ("list_files", "read_file", "search", "write_file", "replace", "run", "run_tests", "submit")
    run_defaults = {
        "orchestrator": {"batch_size": 4, "group_size": 2, "max_tokens": 128, "temperature": 1.0,
                         "async_level": 1, "max_off_policy_steps": 4},
        "trainer": {"lr": 4e-4, "seq_len": 4096},
        "inference": {"max_model_len": 4096, "kv_slots": 16, "max_batch_size": 16},
        "env": {"max_turns": 4},
    }

    def __init__(self, config: SweConfig | None = None) -> None:
        super().__init__(config)
        self._records: dict[str, dict[str, Any]] | None = None
        self.root: Path | None = None  # this process's scratch checkouts
        self._task_problems: dict[str, str | None] = {}  # instance_id -> cause (None: the task runs)
        self._task_locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()

    def _scratch_root(self) -> Path:
        """``$TMP/primerl-swe/<pid>``; roots of processes that died (killed workers) are removed."""
        if self.root is None:
            base = Path(tempfile.gettempdir()) / "primerl-swe"
            base.mkdir(exist_ok=True)
            for old in base.iterdir():
                if old.name.isdigit() and not Path(f"/proc/{old.name}").exists():
                    shutil.rmtree(old, ignore_errors=True)
            self.root = base / str(os.getpid())
            self.root.mkdir(exist_ok=True)
        return self.root

    def close(self) -> None:
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)

    # -- tasks -----------------------------------------------------------------------------

    def records(self) -> dict[str, dict[str, Any]]:
        if self._records is None:
            if self.config.tasks is None:
                raise ValueError("the swe environment needs --env.tasks FILE (a SWE-bench-format JSONL); "
                                 "`python -m primerl_swe.build_tasks --out DIR` builds the shipped set")
            self._records = {r["instance_id"]: r for r in load_tasks(self.config.tasks)}
        return self._records

    def tasks(self, split: str) -> Iterator[Task]:
        if split not in ("train", "eval"):
            raise ValueError(f"swe has splits 'train' and 'eval', not {split!r}")
        for rec in self.records().values():
            yield Task(id=rec["instance_id"], prompt=f"Issue:\n{rec['problem_statement']}",
                       info={"instance_id": rec["instance_id"]})

    def _record(self, task: Task) -> dict[str, Any]:
        return self.records()[task.info.get("instance_id", task.id)]

    # -- episode -----------------------------------------------------------------------------

    def setup(self, task: Task) -> dict[str, Any]:
        rec = self._record(task)
        sandbox.resolve(self.config.sandbox)  # fail before the episode if there is no sandbox
        repo.require_git()
        try:
            work = repo.checkout(rec["repo"], rec["base_commit"], parent=self._scratch_root())
        except repo.RepoError as e:
            raise TaskError(f"repository or base_commit unusable: {e}", task_id=rec["instance_id"]) from None
        return {"workdir": str(work), "submitted": False}

    def cleanup(self, task: Task, state: dict[str, Any]) -> None:
        if state.get("workdir"):
            repo.remove(Path(state["workdir"]))

    def reward(self, task: Task, state: dict[str, Any]) -> float:
        rec = self._record(task)
        if state.get("task_error"):  # the sandbox failed under a tool during the episode
            raise TaskError(state["task_error"], task_id=rec["instance_id"])
        return self.evaluate(rec, Path(state["workdir"]))

    def _limits(self, timeout_s: float) -> sandbox.Limits:
        return sandbox.Limits(wall_s=timeout_s, cpu_s=int(timeout_s), memory_mb=self.config.memory_mb)

    def evaluate(self, rec: dict[str, Any], work: Path) -> float:
        """SWE-bench's rule: reset the test files, apply test_patch, run FAIL_TO_PASS + PASS_TO_PASS.
        Raises :class:`TaskError` when the task's tests cannot run (see the module docstring)."""
        return self._score(rec, work)[0]

    def _score(self, rec: dict[str, Any], work: Path) -> tuple[float, dict[str, str]]:
        """(reward, {test: outcome} of the tests that did not pass)."""
        if not rec["FAIL_TO_PASS"]:  # nothing tells a fix from no fix
            raise TaskError("the task lists no FAIL_TO_PASS tests", task_id=rec["instance_id"])
        tests = [*rec["FAIL_TO_PASS"], *rec["PASS_TO_PASS"]]
        outcomes: dict[str, str] = {}
        try:
            repo.reset_files(work, rec["base_commit"], _touched(rec["test_patch"]))
            repo.apply_patch(work, rec["test_patch"])
            outcomes, _ = repo.run_tests(work, tests, kind=self.config.sandbox,
                                         limits=self._limits(self.config.test_timeout_s))
        except sandbox.SandboxError as e:  # the sandbox itself failed: nothing of the model's ran
            raise TaskError(str(e), task_id=rec["instance_id"]) from None
        except (repo.RepoError, OSError):
            pass  # the agent may have broken its checkout; whether the task is broken is checked below
        failing = {t: outcomes.get(t, "no report") for t in tests if outcomes.get(t) != "PASSED"}
        if not failing:
            return 1.0, failing
        if outcomes and all(outcomes.get(t) == "PASSED" for t in rec["PASS_TO_PASS"]):
            return 0.0, failing  # the harness ran the suite; only FAIL_TO_PASS tests failed
        problem = self.task_problem(rec)
        if problem is not None:
            raise TaskError(problem, task_id=rec["instance_id"])
        return 0.0, failing  # the task runs on its clean base: the failure is the model's

    def task_problem(self, rec: dict[str, Any]) -> str | None:
        """Why ``rec``'s tests cannot run, or None: the harness probe, then the task's tests
        on a clean ``base_commit`` with ``test_patch`` applied (every PASS_TO_PASS test must
        pass there, as in SWE-bench). Cached per process (harness and timeout failures are
        not: they may pass)."""
        problem = sandbox.harness_problem(self.config.sandbox)
        if problem is not None:
            return problem
        iid = rec["instance_id"]
        with self._lock:
            lock = self._task_locks.setdefault(iid, threading.Lock())
        with lock:
            if iid not in self._task_problems:
                problem, cacheable = self._base_problem(rec)
                if not cacheable:
                    return problem
                self._task_problems[iid] = problem
            return self._task_problems[iid]

    def _base_problem(self, rec: dict[str, Any]) -> tuple[str | None, bool]:
        base = rec["base_commit"]
        try:
            work = repo.checkout(rec["repo"], base)
        except repo.RepoError as e:
            return f"repository or base_commit unusable: {e}", True
        try:
            try:
                repo.apply_patch(work, rec["test_patch"])
            except repo.RepoError as e:
                return f"test_patch does not apply to base_commit {base[:12]}: {e}", True
            timeout = self.config.test_timeout_s
            try:
                outcomes, result = repo.run_tests(work, [*rec["FAIL_TO_PASS"], *rec["PASS_TO_PASS"]],
                                                  kind=self.config.sandbox, limits=self._limits(timeout))
            except sandbox.SandboxError as e:
                return str(e), False
            where = f"on base_commit {base[:12]} with test_patch applied"
            if result.timed_out:
                return (f"the task's tests time out after {timeout:g}s {where}; raise --env.test_timeout_s "
                        f"(output: {sandbox._tail(result.output)})"), False
            if not outcomes:
                return f"no test reports {where}: {sandbox._tail(result.describe())}", True
            bad = [f"{t} ({outcomes.get(t, 'no report')})" for t in rec["PASS_TO_PASS"] if outcomes.get(t) != "PASSED"]
            if bad:
                more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
                said = [ln for ln in result.output.splitlines() if re.match(r"(FAILED|ERROR)\b", ln)][:8]
                said = " | ".join([*said, result.output.strip().splitlines()[-1]]) if said else sandbox._tail(result.output)
                return f"PASS_TO_PASS tests do not pass {where}: {', '.join(bad[:5])}{more}; pytest said: {said}", True
            return None, True
        finally:
            repo.remove(work)

    # -- tools (each gets the episode state first) -------------------------------------------

    def _path(self, state: dict[str, Any], path: str) -> Path:
        root = Path(state["workdir"]).resolve()
        p = (root / path).resolve()  # follows symlinks: a link pointing outside is refused
        if p != root and root not in p.parents:
            raise PermissionError(f"{path} is outside the repository")
        return p

    def list_files(self, state: dict[str, Any], path: str = ".") -> str:
        """List the files under a directory of the repository."""
        base = self._path(state, path)
        root = Path(state["workdir"]).resolve()
        files = sorted(str(p.relative_to(root)) for p in base.rglob("*")
                       if p.is_file() and ".git" not in p.relative_to(root).parts)
        return "\n".join(files[:500]) or "(no files)"

    def read_file(self, state: dict[str, Any], path: str, start: int = 1, end: int = 200) -> str:
        """Show lines start..end of a file, numbered."""
        lines = self._path(state, path).read_text(errors="replace").splitlines()
        return "\n".join(f"{i:5d}  {line}" for i, line in enumerate(lines[start - 1 : end], start))

    def search(self, state: dict[str, Any], pattern: str, path: str = ".") -> str:
        """Lines matching a regular expression, as file:line: text."""
        rx = re.compile(pattern)
        root = Path(state["workdir"]).resolve()
        hits = []
        for p in sorted(self._path(state, path).rglob("*")):
            if p.is_file() and ".git" not in p.relative_to(root).parts:
                for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
                    if rx.search(line):
                        hits.append(f"{p.relative_to(root)}:{i}: {line}")
        return "\n".join(hits[:200]) or "(no matches)"

    def write_file(self, state: dict[str, Any], path: str, content: str) -> str:
        """Create or overwrite a file."""
        p = self._path(state, path)
        if p.is_symlink():
            raise PermissionError(f"{path} is a symlink")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(content)
        return f"wrote {len(content)} characters to {path}"

    def replace(self, state: dict[str, Any], path: str, old: str, new: str) -> str:
        """Replace the one occurrence of old with new in a file."""
        p = self._path(state, path)
        text = p.read_text()
        n = text.count(old)
        if n != 1:
            return f"error: old text occurs {n} times in {path}; it must occur exactly once"
        p.write_text(text.replace(old, new))
        return f"edited {path}"

    def _sandboxed(self, state: dict[str, Any], command: str, timeout_s: float) -> str:
        try:
            return repo.run(command, Path(state["workdir"]), kind=self.config.sandbox,
                            limits=self._limits(timeout_s)).describe()
        except sandbox.SandboxError as e:  # not the model's doing: the episode cannot be scored
            state["task_error"] = str(e)
            raise TaskError(str(e)) from None

    def run(self, state: dict[str, Any], command: str) -> str:
        """Run a shell command in the repository (sandboxed, no network)."""
        return self._sandboxed(state, command, self.config.command_timeout_s)

    def run_tests(self, state: dict[str, Any], tests: str = "") -> str:
        """Run pytest on the given test ids (space-separated), or on all tests."""
        return self._sandboxed(state, repo.pytest_command(f"-q {tests}"), self.config.test_timeout_s)

    def submit(self, state: dict[str, Any]) -> str:
        """Finish: your changes are evaluated."""
        state["submitted"] = True
        return "submitted"

    # -- dataset validation ------------------------------------------------------------------

    def check(self, oracle: bool = False, workers: int = 4) -> list[dict[str, Any]]:
        """Each task's reward with the gold patch applied (``oracle``) or with none:
        ``{"instance_id", "reward", "error"}``; a task that cannot be run has reward None and
        its cause in ``error``; with ``oracle``, a reward below 1 lists the tests that did not pass
        in ``failing``."""
        from concurrent.futures import ThreadPoolExecutor

        sandbox.resolve(self.config.sandbox)  # no sandbox or no git: one clear error, not one per task
        repo.require_git()

        def one(rec: dict[str, Any]) -> dict[str, Any]:
            row: dict[str, Any] = {"instance_id": rec["instance_id"], "reward": None, "error": None}
            try:
                work = repo.checkout(rec["repo"], rec["base_commit"])
            except repo.RepoError as e:
                return {**row, "error": f"repository or base_commit unusable: {e}"}
            try:
                if oracle:
                    try:
                        repo.apply_patch(work, rec["patch"])
                    except repo.RepoError as e:
                        return {**row, "error": f"the gold patch does not apply to base_commit: {e}"}
                reward, failing = self._score(rec, work)
                return {**row, "reward": reward, **({"failing": failing} if oracle and failing else {})}
            except TaskError as e:
                return {**row, "error": e.cause}
            finally:
                repo.remove(work)

        with ThreadPoolExecutor(max_workers=workers) as pool:
            return list(pool.map(one, self.records().values()))


def _touched(patch: str) -> list[str]:
    """The files a patch changes (both sides of a rename)."""
    files: list[str] = []
    for a, b in re.findall(r"^diff --git a/(\S+) b/(\S+)", patch, re.M):
        files += [f for f in (a, b) if f not in files]
    return files
