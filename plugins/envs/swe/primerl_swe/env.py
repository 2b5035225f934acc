"""The ``swe`` environment: fix a bug in a real repository with tools, judged by its tests.

Tasks come from a SWE-bench-format JSONL (``--env.tasks FILE``, see :mod:`primerl_swe.records`;
``repo`` is a local git repository, a path relative to the file or SWE-bench's
``owner/name`` under ``--env.repos DIR``). Without ``--env.tasks`` the shipped set
(``--env.taskset``) is built on first use into ``--env.cache_dir``.

Each task's tests run in an environment of its own (:mod:`primerl_swe.testenv`): the
checkout installed the way the ecosystem installs a project for development, layered over
the interpreter running primerl, made on the task's first episode and cached. Each episode
gets a scratch checkout of ``base_commit``, with what the task's install wrote into its tree
(generated files, :mod:`primerl_swe.generated`) laid in; the agent inspects and edits it with file tools
(checked to stay inside the checkout, symlinks included) and runs commands and tests in the
sandbox (:mod:`primerl_swe.sandbox`). When the agent submits or runs out of turns, the files
that ``test_patch`` touches are reset to ``base_commit``, ``test_patch`` is applied, and the
reward is 1 if every FAIL_TO_PASS and PASS_TO_PASS test passes (or is an expected failure),
else 0 — the SWE-bench harness's rule. Outcomes come from pytest's own reports
(:mod:`primerl_swe.pytest_report`), never from its text.

``primerl env check swe --tasks FILE [--oracle] [--json] [--jobs N]`` validates a dataset the
same way: with ``--oracle`` the gold ``patch`` is applied first, without it nothing is.

Harness failures are errors, never rewards. A task whose tests cannot run raises
:class:`primerl.envs.TaskError` with the cause:

* its repository is missing or unusable, its environment cannot be made (the recipe's
  command and output), ``test_patch`` does not apply;
* the **setup check** (once per task, cached with its environment) fails: with the gold
  patch and ``test_patch`` applied, the test files must collect (a module that is a file the
  build writes but the install did not is named), every listed test must be
  collected, and every module the tests import that the checkout holds must come from the
  checkout — an installed copy that shadows it is named with the path it came from;
* a PASS_TO_PASS test does not pass on the clean ``base_commit`` with ``test_patch``
  applied (checked only when an episode fails in another way than "only FAIL_TO_PASS tests
  failed", cached per process).

Failures the model caused (its edit breaks collection, its tests fail, it broke its
checkout, it deleted the package so that an installed copy is imported) stay reward 0.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs

from primerl.envs import Task, TaskError
from primerl.envs.multiturn import MultiTurnConfig, ToolEnv
from primerl_swe import build_tasks, generated, repo, sandbox, testenv
from primerl_swe.records import TaskRecord, load_tasks

__all__ = ["Swe", "SweConfig", "load_tasks"]


def _check_file(_inst: Any, attribute: attrs.Attribute, value: str | None) -> None:
    if value is not None and not Path(value).expanduser().is_file():
        raise ValueError(f"{attribute.name}: {value!r} is not a file; leave it unset for the shipped set, or build "
                         "one with `python -m primerl_swe.build_tasks --out DIR` and pass DIR/tasks.jsonl")


def _check_dir(_inst: Any, attribute: attrs.Attribute, value: str | None) -> None:
    if value is not None and not Path(value).expanduser().is_dir():
        raise ValueError(f"{attribute.name}: {value!r} is not a folder (it holds the repositories as "
                         "DIR/owner/name or DIR/owner__name)")


@attrs.define(kw_only=True)
class SweConfig(MultiTurnConfig):
    # a SWE-bench-format JSONL; unset: the shipped task set named by taskset, built on first use
    tasks: str | None = attrs.field(default=None, validator=_check_file)
    # the shipped set used when tasks is unset: pyutils (21 bugs in one library) or layouts
    # (libraries under src/, declared in pyproject.toml only, or installed in the environment too)
    taskset: str = attrs.field(default="pyutils", validator=attrs.validators.in_(tuple(build_tasks.SETS)))
    # where rows naming their repo as owner/name find it: DIR/owner/name or DIR/owner__name
    repos: str | None = attrs.field(default=None, validator=_check_dir)
    # built shipped sets and each task's environment (envs/<repo>-<commit>-<key>), reused across runs
    cache_dir: str = "~/.cache/primerl/swe"
    sandbox: str = attrs.field(default="auto", validator=attrs.validators.in_(("auto", "bwrap", "rlimit")))
    command_timeout_s: float = attrs.field(default=30.0, validator=attrs.validators.gt(0))
    test_timeout_s: float = attrs.field(default=120.0, validator=attrs.validators.gt(0))
    setup_timeout_s: float = attrs.field(default=600.0, validator=attrs.validators.gt(0))  # one recipe command
    memory_mb: int = attrs.field(default=2048, validator=attrs.validators.ge(64))
    max_turns: int = attrs.field(default=20, validator=attrs.validators.ge(1))
    turn_timeout_s: float = attrs.field(default=180.0, validator=attrs.validators.gt(0))


@attrs.frozen
class _Checked:
    """A task's setup check: why it cannot run (None: it runs) and the modules its tests import
    from the checkout. ``lasting`` False: a failure that may pass next time (the harness probe,
    a timeout), checked again rather than kept."""

    problem: str | None
    modules: tuple[str, ...] = ()
    lasting: bool = True


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
        self._records: dict[str, TaskRecord] | None = None
        self.root: Path | None = None  # this instance's scratch checkouts (_scratch_root)
        self._root_pid = 0  # the process that made self.root (a fork's copy makes its own)
        self._root_lock: Any = None  # the open .lock file whose flock says self.root is in use
        self._checked: dict[str, _Checked] = {}  # instance_id -> its setup check
        self._base_problems: dict[str, str | None] = {}  # instance_id -> cause (None: P2P pass on base)
        self._envs: dict[str, testenv.TestEnv] = {}  # instance_id -> its environment (bubblewrap: cached)
        self._task_locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()

    @property
    def cache_dir(self) -> Path:
        return Path(self.config.cache_dir).expanduser()

    def _scratch_root(self) -> Path:
        """This instance's scratch checkouts: ``$TMP/primerl-swe/<pid>-XXXX``, owned through a lock
        held on its ``.lock`` file while the instance lives. Roots whose lock nobody holds (their
        process died: a killed worker) are removed; a lock, unlike a pid, means the same in every
        pid namespace and is never reused by an unrelated process."""
        with self._lock:
            if self.root is None or self._root_pid != os.getpid():  # none yet, or a fork's copy
                base = Path(tempfile.gettempdir()) / "primerl-swe"
                base.mkdir(exist_ok=True)
                for lock in base.glob("*.lock"):
                    _reap_if_unowned(lock)
                root = Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=base))
                self._root_lock = open(root.with_name(root.name + ".lock"), "w")  # noqa: SIM115 - held while we live
                fcntl.flock(self._root_lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self.root, self._root_pid = root, os.getpid()
            self.root.mkdir(parents=True, exist_ok=True)  # removed under us (a cleaner of /tmp): make it again
            return self.root

    def close(self) -> None:
        with self._lock:
            if self.root is not None and self._root_pid == os.getpid():  # a forked copy leaves its parent's root be
                shutil.rmtree(self.root, ignore_errors=True)
                Path(self._root_lock.name).unlink(missing_ok=True)
                self._root_lock.close()
            self.root = None

    # -- tasks -----------------------------------------------------------------------------

    def records(self) -> dict[str, TaskRecord]:
        if self._records is None:
            path = self.config.tasks
            if path is None:
                path = build_tasks.shipped(self.config.taskset, self.cache_dir / "tasks", log=_log)
            self._records = {r.instance_id: r for r in load_tasks(Path(path).expanduser(), self.config.repos)}
        return self._records

    def tasks(self, split: str) -> Iterator[Task]:
        if split not in ("train", "eval"):
            raise ValueError(f"swe has splits 'train' and 'eval', not {split!r}")
        for rec in self.records().values():
            yield Task(id=rec.instance_id, prompt=f"Issue:\n{rec.problem_statement}",
                       info={"instance_id": rec.instance_id})

    def _record(self, task: Task) -> TaskRecord:
        return self.records()[task.info.get("instance_id", task.id)]

    # -- a task's environment and its setup check -------------------------------------------------

    def _checkout(self, rec: TaskRecord, parent: Path | None = None) -> Path:
        if rec.repo_problem is not None:
            raise TaskError(rec.repo_problem, task_id=rec.instance_id)
        try:
            return repo.checkout(rec.repo, rec.base_commit, parent=parent or self._scratch_root())
        except repo.RepoError as e:
            raise TaskError(f"repository or base_commit unusable: {e}", task_id=rec.instance_id) from None

    def _kind(self) -> str:
        return sandbox.resolve(self.config.sandbox)

    def test_env(self, rec: TaskRecord, work: Path, *, network: bool = False) -> testenv.TestEnv:
        """The environment the tests of ``work`` (a fresh checkout of ``rec``) run in: the task's
        cached one (bubblewrap), whose recipe's output in the tree (generated files) is laid
        into ``work``, or one made for ``work`` in place (rlimit, removed with it)."""
        kind = self._kind()
        try:
            if kind != "bwrap":
                return testenv.make(testenv_path(work), work, rec, kind=kind, checkout_at=str(work),
                                    network=network, git_dir=repo.git_dir(work), timeout_s=self.config.setup_timeout_s)
            with self._lock:
                lock = self._task_locks.setdefault(f"env:{rec.instance_id}", threading.Lock())
            with lock:
                env = self._envs.get(rec.instance_id)
                if env is None:
                    def fresh():
                        w = self._checkout(rec)
                        return w, repo.git_dir(w), lambda: repo.remove(w)
                    env = testenv.cached(self.cache_dir, rec, fresh, kind=kind, network=network,
                                         timeout_s=self.config.setup_timeout_s)
                    if env.setup_s:
                        _log(f"made the environment of {rec.instance_id} in {env.setup_s:.1f}s ({env.root})")
                    self._envs[rec.instance_id] = env
            env.lay_into(work)
            return env
        except generated.WrittenError as e:
            raise TaskError(str(e), task_id=rec.instance_id) from None
        except testenv.SetupFailed as e:
            raise TaskError(str(e), task_id=rec.instance_id) from None
        except sandbox.SandboxError as e:
            raise TaskError(str(e), task_id=rec.instance_id) from None

    def setup_check(self, rec: TaskRecord) -> _Checked:
        """The task's setup check (see the module docstring), once per task: cached in this
        process and, beside the task's environment, on disk."""
        with self._lock:
            lock = self._task_locks.setdefault(f"check:{rec.instance_id}", threading.Lock())
        with lock:
            checked = self._checked.get(rec.instance_id)
            if checked is None:
                checked = self._setup_check(rec)
                if checked.lasting:
                    self._checked[rec.instance_id] = checked
            return checked

    def _check_key(self, rec: TaskRecord) -> str:
        blob = json.dumps([rec.patch, rec.test_patch, rec.tests, rec.recipe.test_cmd])
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def _setup_check(self, rec: TaskRecord) -> _Checked:
        problem = sandbox.harness_problem(self.config.sandbox)
        if problem is not None:
            return _Checked(problem, lasting=False)
        try:
            work = self._checkout(rec)
        except TaskError as e:
            return _Checked(e.cause)
        try:
            env = self.test_env(rec, work)
            saved = env.root / "checks" / f"{self._check_key(rec)}.json"
            if self._kind() == "bwrap" and saved.is_file():
                data = json.loads(saved.read_text())
                return _Checked(data["problem"], tuple(data["modules"]))
            checked = self._collect_check(rec, work, env)
            if self._kind() == "bwrap" and checked.lasting:
                saved.parent.mkdir(exist_ok=True)
                tmp = saved.with_name(saved.name + f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps({"problem": checked.problem, "modules": list(checked.modules)}))
                os.replace(tmp, saved)
            return checked
        except TaskError as e:
            return _Checked(e.cause)
        finally:
            repo.remove(work)
            shutil.rmtree(testenv_path(work), ignore_errors=True)

    def _collect_check(self, rec: TaskRecord, work: Path, env: testenv.TestEnv) -> _Checked:
        with_patch = bool(rec.patch.strip())
        try:
            repo.apply_patch(work, rec.patch)
        except repo.RepoError as e:
            return _Checked(f"the gold patch does not apply to base_commit {rec.base_commit[:12]}: {e}")
        try:
            repo.apply_patch(work, rec.test_patch)
        except repo.RepoError as e:
            return _Checked(f"test_patch does not apply to base_commit {rec.base_commit[:12]}: {e}")
        try:
            report, result = repo.run_tests(work, rec.tests, env=env, kind=self.config.sandbox,
                                            limits=self._limits(self.config.test_timeout_s),
                                            test_cmd=rec.recipe.test_cmd, collect_only=True)
        except sandbox.SandboxError as e:
            return _Checked(str(e), lasting=False)
        where = "with the gold patch and test_patch applied" if with_patch else "with test_patch applied"
        if result.timed_out:
            return _Checked(f"collecting the tests timed out after {self.config.test_timeout_s:g}s {where}; raise "
                            f"--env.test_timeout_s (output: {sandbox._tail(result.output)})", lasting=False)
        install = rec.recipe.install or (testenv.DEFAULT_INSTALL if env.installed
                                         else "none: the checkout declares no project")

        def generated_file(said: str) -> str:  # the module it cannot import is a file the build writes
            return generated.explain(said, work, repo.git_dir(work), env.written, install)

        if not report.written:
            return _Checked(f"pytest did not run {where}: {sandbox._tail(result.describe())}"
                            f"{generated_file(result.output)}")
        if report.shadowed:
            name, path = next(iter(sorted(report.shadowed.items())))
            return _Checked(f"the tests import {name} from {path}, not from the checkout: an installed copy shadows "
                            f"the code under test{' (and ' + str(len(report.shadowed) - 1) + ' more)' if len(report.shadowed) > 1 else ''}; "
                            f"the task's environment ({env.root}) must install the checkout (its `install` recipe)")
        if report.collect_errors:
            err = report.collect_errors[0]
            more = f" (and {len(report.collect_errors) - 1} more)" if len(report.collect_errors) > 1 else ""
            return _Checked(f"the tests cannot be collected {where}: {err['nodeid']}: {err['message']}{more}"
                            f"{generated_file(err['message'])}")
        listed = rec.tests if with_patch else list(rec.pass_to_pass)
        missing = [t for t in listed if t not in set(report.collected)]
        if missing:
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            return _Checked(f"{len(missing)} listed tests are not collected by pytest {where}: "
                            f"{', '.join(missing[:3])}{more} (node ids must be as pytest writes them)")
        return _Checked(None, report.from_checkout)

    def prepare(self, network: bool = True, jobs: int = 4) -> list[dict[str, Any]]:
        """Make every task's environment (with ``network``, for recipes that download) and run
        its setup check: ``{"instance_id", "error", "setup_s"}`` per task."""
        from concurrent.futures import ThreadPoolExecutor

        self._kind()
        repo.require_git()

        def one(rec: TaskRecord) -> dict[str, Any]:
            row: dict[str, Any] = {"instance_id": rec.instance_id, "error": None, "setup_s": 0.0}
            try:
                work = self._checkout(rec)
            except TaskError as e:
                return {**row, "error": e.cause}
            try:
                env = self.test_env(rec, work, network=network)
                row["setup_s"] = round(env.setup_s, 2)
            except TaskError as e:
                return {**row, "error": e.cause}
            finally:
                repo.remove(work)
                shutil.rmtree(testenv_path(work), ignore_errors=True)
            return {**row, "error": self.setup_check(rec).problem}

        with ThreadPoolExecutor(max_workers=jobs) as pool:
            return list(pool.map(one, self.records().values()))

    # -- episode -----------------------------------------------------------------------------

    def setup(self, task: Task) -> dict[str, Any]:
        rec = self._record(task)
        self._kind()  # fail before the episode if there is no sandbox
        repo.require_git()
        checked = self.setup_check(rec)
        if checked.problem is not None:
            raise TaskError(checked.problem, task_id=rec.instance_id)
        work = self._checkout(rec)
        try:
            env = self.test_env(rec, work)
        except BaseException:
            repo.remove(work)
            raise
        return {"workdir": str(work), "env": str(env.root), "checkout_at": env.checkout_at,
                "modules": list(checked.modules), "submitted": False}

    def cleanup(self, task: Task, state: dict[str, Any]) -> None:
        if state.get("workdir"):
            repo.remove(Path(state["workdir"]))
            shutil.rmtree(testenv_path(Path(state["workdir"])), ignore_errors=True)

    def reward(self, task: Task, state: dict[str, Any]) -> float:
        rec = self._record(task)
        if state.get("task_error"):  # the sandbox failed under a tool during the episode
            raise TaskError(state["task_error"], task_id=rec.instance_id)
        return self.evaluate(rec, Path(state["workdir"]), _env(state), tuple(state.get("modules", ())))

    def _limits(self, timeout_s: float) -> sandbox.Limits:
        return sandbox.Limits(wall_s=timeout_s, cpu_s=int(timeout_s), memory_mb=self.config.memory_mb)

    def evaluate(self, rec: TaskRecord, work: Path, env: testenv.TestEnv, modules: tuple[str, ...] = ()) -> float:
        """SWE-bench's rule: reset the test files, apply test_patch, run FAIL_TO_PASS + PASS_TO_PASS.
        Raises :class:`TaskError` when the task's tests cannot run (see the module docstring)."""
        return self._score(rec, work, env, modules)[0]

    def _score(self, rec: TaskRecord, work: Path, env: testenv.TestEnv,
               modules: tuple[str, ...]) -> tuple[float, dict[str, str]]:
        """(reward, {test: outcome} of the tests that did not pass)."""
        if not rec.fail_to_pass:  # nothing tells a fix from no fix
            raise TaskError("the task lists no FAIL_TO_PASS tests", task_id=rec.instance_id)
        tests = rec.tests
        report = repo.Report()
        try:
            repo.reset_files(work, rec.base_commit, _touched(rec.test_patch))
            repo.apply_patch(work, rec.test_patch)
            report, _ = repo.run_tests(work, tests, env=env, kind=self.config.sandbox, modules=modules,
                                       limits=self._limits(self.config.test_timeout_s), test_cmd=rec.recipe.test_cmd)
        except sandbox.SandboxError as e:  # the sandbox itself failed: nothing of the model's ran
            raise TaskError(str(e), task_id=rec.instance_id) from None
        except (repo.RepoError, OSError):
            pass  # the agent may have broken its checkout; whether the task is broken is checked below
        failing = {t: report.outcomes.get(t, "no report") for t in tests if not report.passed(t)}
        if report.shadowed:  # the setup check saw these come from the checkout: the model's edit moved them
            return 0.0, {**failing, **{f"import {m}": f"from {p}, outside the checkout" for m, p in report.shadowed.items()}}
        if not failing:
            return 1.0, failing
        if report.outcomes and all(report.passed(t) for t in rec.pass_to_pass):
            return 0.0, failing  # the harness ran the suite; only FAIL_TO_PASS tests failed
        problem = self.task_problem(rec)
        if problem is not None:
            raise TaskError(problem, task_id=rec.instance_id)
        return 0.0, failing  # the task runs on its clean base: the failure is the model's

    def task_problem(self, rec: TaskRecord) -> str | None:
        """Why ``rec``'s tests cannot run, or None: the harness probe, the setup check, then the
        task's tests on a clean ``base_commit`` with ``test_patch`` applied (every PASS_TO_PASS
        test must pass there, as in SWE-bench). Cached per process (harness and timeout failures
        are not: they may pass)."""
        problem = sandbox.harness_problem(self.config.sandbox) or self.setup_check(rec).problem
        if problem is not None:
            return problem
        iid = rec.instance_id
        with self._lock:
            lock = self._task_locks.setdefault(f"base:{iid}", threading.Lock())
        with lock:
            if iid not in self._base_problems:
                problem, cacheable = self._base_problem(rec)
                if not cacheable:
                    return problem
                self._base_problems[iid] = problem
            return self._base_problems[iid]

    def _base_problem(self, rec: TaskRecord) -> tuple[str | None, bool]:
        base = rec.base_commit
        try:
            work = self._checkout(rec)
        except TaskError as e:
            return e.cause, True
        try:
            try:
                env = self.test_env(rec, work)
            except TaskError as e:
                return e.cause, True
            try:
                repo.apply_patch(work, rec.test_patch)
            except repo.RepoError as e:
                return f"test_patch does not apply to base_commit {base[:12]}: {e}", True
            timeout = self.config.test_timeout_s
            try:
                report, result = repo.run_tests(work, rec.tests, env=env, kind=self.config.sandbox,
                                                limits=self._limits(timeout), test_cmd=rec.recipe.test_cmd)
            except sandbox.SandboxError as e:
                return str(e), False
            where = f"on base_commit {base[:12]} with test_patch applied"
            if result.timed_out:
                return (f"the task's tests time out after {timeout:g}s {where}; raise --env.test_timeout_s "
                        f"(output: {sandbox._tail(result.output)})"), False
            if not report.outcomes:
                return f"no test reports {where}: {sandbox._tail(result.describe())}", True
            bad = [f"{t} ({report.outcomes.get(t, 'no report')})" for t in rec.pass_to_pass if not report.passed(t)]
            if bad:
                more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
                errors = [f"{e['nodeid']}: {e['message']}" for e in report.collect_errors[:2]]
                said = " | ".join(errors) or sandbox._tail(result.output, lines=6)
                return f"PASS_TO_PASS tests do not pass {where}: {', '.join(bad[:5])}{more}; pytest said: {said}", True
            return None, True
        finally:
            repo.remove(work)
            shutil.rmtree(testenv_path(work), ignore_errors=True)

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
            return repo.run(command, Path(state["workdir"]), env=_env(state), kind=self.config.sandbox,
                            limits=self._limits(timeout_s)).describe()
        except sandbox.SandboxError as e:  # not the model's doing: the episode cannot be scored
            state["task_error"] = str(e)
            raise TaskError(str(e)) from None

    def run(self, state: dict[str, Any], command: str) -> str:
        """Run a shell command in the repository (sandboxed, no network)."""
        return self._sandboxed(state, command, self.config.command_timeout_s)

    def run_tests(self, state: dict[str, Any], tests: str = "") -> str:
        """Run pytest on the given test ids (space-separated), or on all tests."""
        return self._sandboxed(state, f"python -m pytest -p no:cacheprovider -q {tests}".strip(),
                               self.config.test_timeout_s)

    def submit(self, state: dict[str, Any]) -> str:
        """Finish: your changes are evaluated."""
        state["submitted"] = True
        return "submitted"

    # -- dataset validation ------------------------------------------------------------------

    def check(self, oracle: bool = False, workers: int = 4) -> list[dict[str, Any]]:
        """Each task's reward with the gold patch applied (``oracle``) or with none:
        ``{"instance_id", "reward", "error"}``; a task that cannot be run has reward None and
        its cause in ``error``; with ``oracle``, a reward below 1 lists the tests that did not pass
        in ``failing``. ``workers`` tasks are checked at once."""
        from concurrent.futures import ThreadPoolExecutor

        records = list(self.records().values())  # the task file's own errors first: they need no machine
        self._kind()  # no sandbox or no git: one clear error, not one per task
        repo.require_git()

        def one(rec: TaskRecord) -> dict[str, Any]:
            row: dict[str, Any] = {"instance_id": rec.instance_id, "reward": None, "error": None}
            try:
                checked = self.setup_check(rec)
                if checked.problem is not None:
                    return {**row, "error": checked.problem}
                work = self._checkout(rec)
            except TaskError as e:
                return {**row, "error": e.cause}
            try:
                env = self.test_env(rec, work)
                if oracle:
                    try:
                        repo.apply_patch(work, rec.patch)
                    except repo.RepoError as e:
                        return {**row, "error": f"the gold patch does not apply to base_commit: {e}"}
                reward, failing = self._score(rec, work, env, checked.modules)
                return {**row, "reward": reward, **({"failing": failing} if oracle and failing else {})}
            except TaskError as e:
                return {**row, "error": e.cause}
            finally:
                repo.remove(work)
                shutil.rmtree(testenv_path(work), ignore_errors=True)

        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            return list(pool.map(one, records))


def _reap_if_unowned(lock: Path) -> None:
    """Remove the scratch root that ``lock`` guards if no process holds the lock any more."""
    try:
        with open(lock, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises while its owner lives
            shutil.rmtree(lock.with_suffix(""), ignore_errors=True)
            lock.unlink(missing_ok=True)
    except OSError:  # held (or gone already): not ours to remove
        pass


def testenv_path(work: Path) -> Path:
    """Where an environment made for one checkout lives (the rlimit sandbox): beside it."""
    return Path(work).with_name(Path(work).name + ".env")


def _env(state: dict[str, Any]) -> testenv.TestEnv:
    return testenv.TestEnv(root=Path(state["env"]), checkout_at=state["checkout_at"])


def _log(msg: str) -> None:
    """To stderr: ``env check --json`` prints only its JSON on stdout."""
    print(f"[swe {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _touched(patch: str) -> list[str]:
    """The files a patch changes (both sides of a rename)."""
    files: list[str] = []
    for a, b in re.findall(r"^diff --git a/(\S+) b/(\S+)", patch, re.M):
        files += [f for f in (a, b) if f not in files]
    return files
