"""SWE-bench-format task files: JSON Lines in, validated task records out.

A task file holds one JSON object per line, split on ``\\n`` only (JSON Lines: U+2028 and
the other characters ``str.splitlines`` also breaks on are text, not line ends). The fields
are SWE-bench's: ``instance_id``, ``repo``, ``base_commit``, ``problem_statement``,
``patch``, ``test_patch``, ``FAIL_TO_PASS``, ``PASS_TO_PASS`` (lists, or SWE-bench's JSON
strings of lists). Optional, as SWE-bench's harness specs name them: ``pre_install`` (shell
commands run before the install), ``install`` (the command that installs the checkout into
the task's environment), ``pip_packages`` (installed into it with pip) and ``test_cmd`` (the
pytest command the tests run with). Any other field (``hints_text``, ``version``,
``created_at``, ...) is kept as it is.

``repo`` is a local git repository: a path (relative to the task file), or SWE-bench's
``owner/name`` found under ``repos`` (``repos/owner/name`` or ``repos/owner__name``).
A bad row is one :class:`TaskFileError` line naming the file, the line and what is wrong.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import attrs

from primerl.errors import PrimerlError

FIELDS = ("instance_id", "repo", "base_commit", "problem_statement", "patch", "test_patch", "FAIL_TO_PASS",
          "PASS_TO_PASS")
RECIPE_FIELDS = ("pre_install", "install", "pip_packages", "test_cmd")
OWNER_NAME = re.compile(r"^[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+$")


class TaskFileError(PrimerlError, ValueError):
    """A task file that cannot be read: the message names the file, the line and the fix."""


@attrs.frozen(kw_only=True)
class Recipe:
    """How a task's environment is made and its tests are run (SWE-bench's spec keys)."""

    pre_install: tuple[str, ...] = ()  # shell commands, run in the checkout before the install
    install: str | None = None  # None: the checkout's own editable install (see primerl_swe.testenv)
    pip_packages: tuple[str, ...] = ()  # requirement strings pip installs into the task's environment
    test_cmd: str = "pytest"  # the pytest command; primerl adds its report plugin and the test files

    def key(self) -> dict[str, Any]:
        return {"pre_install": list(self.pre_install), "install": self.install, "pip_packages": list(self.pip_packages)}


@attrs.frozen(kw_only=True)
class TaskRecord:
    instance_id: str
    repo: Path  # the local git repository
    repo_name: str  # as the row names it (a path or owner/name)
    repo_problem: str | None  # why ``repo`` cannot be used (not found under --env.repos), or None
    base_commit: str
    problem_statement: str
    patch: str
    test_patch: str
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]
    recipe: Recipe = Recipe()
    extra: dict[str, Any] = attrs.field(factory=dict)  # the row's other fields, kept as they are

    @property
    def tests(self) -> list[str]:
        return [*self.fail_to_pass, *self.pass_to_pass]


def _tests(value: Any, field: str, where: str) -> tuple[str, ...]:
    if isinstance(value, str):  # SWE-bench ships these as JSON strings
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise TaskFileError(f"{where}: {field} is a string that is not a JSON list ({e.msg})") from None
    if not isinstance(value, list) or not all(isinstance(t, str) and t for t in value):
        raise TaskFileError(f"{where}: {field} must be a list of pytest node ids (strings)")
    return tuple(value)


def _commands(value: Any, field: str, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,) if value.strip() else ()
    if isinstance(value, list) and all(isinstance(c, str) for c in value):
        return tuple(c for c in value if c.strip())
    raise TaskFileError(f"{where}: {field} must be a string or a list of strings")


def _recipe(rec: dict[str, Any], where: str) -> Recipe:
    install = rec.get("install")
    if install is not None and not isinstance(install, str):
        raise TaskFileError(f"{where}: install must be a shell command (a string)")
    test_cmd = rec.get("test_cmd") or "pytest"
    if isinstance(test_cmd, list):  # some SWE-bench specs list it
        test_cmd = " ".join(test_cmd)
    if not isinstance(test_cmd, str):
        raise TaskFileError(f"{where}: test_cmd must be a string")
    words = shlex.split(test_cmd)
    if not words or not (words[0] in ("pytest", "py.test") or words[:3] in (["python", "-m", "pytest"],
                                                                           ["python3", "-m", "pytest"])):
        raise TaskFileError(f"{where}: test_cmd {test_cmd!r} does not run pytest; the swe harness reads pytest's "
                            "results (write it as 'pytest ARGS...')")
    return Recipe(pre_install=_commands(rec.get("pre_install"), "pre_install", where),
                  install=install.strip() or None if install else None,
                  pip_packages=_commands(rec.get("pip_packages"), "pip_packages", where), test_cmd=test_cmd)


def resolve_repo(name: str, task_file: Path, repos: Path | None, where: str) -> tuple[Path, str | None]:
    """The local repository a row's ``repo`` names, and why it cannot be used (None: found).

    An ``owner/name`` that is not a path beside the file, with no ``repos`` to look in, is a
    :class:`TaskFileError` (the file cannot be used as given); one missing under ``repos``
    is that task's problem alone, naming the paths tried."""
    path = (task_file.parent / name).resolve()
    if repos is None or not OWNER_NAME.match(name):
        if path.is_dir() or not OWNER_NAME.match(name) or Path(name).is_absolute():
            return path, None
        raise TaskFileError(f"{where}: repo {name!r} is not a folder beside the task file ({path}); clone it as "
                            f"DIR/{name} (or DIR/{name.replace('/', '__')}) and pass --env.repos DIR")
    owner, project = name.split("/")
    tried = [repos / owner / project, repos / f"{owner}__{project}", path]
    for cand in tried:
        if cand.is_dir():
            return cand.resolve(), None
    return tried[0], (f"repo {name!r} not found (tried {', '.join(map(str, tried))}): clone it as "
                      f"{tried[0]} or {tried[1]}")


def load_tasks(path: str | Path, repos: str | Path | None = None) -> list[TaskRecord]:
    """The records of a task file, in order (see the module docstring)."""
    path = Path(path)
    repos = Path(repos).expanduser().resolve() if repos is not None else None
    try:
        text = path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TaskFileError(f"{path}: cannot be read as UTF-8 text ({e})") from None
    out: list[TaskRecord] = []
    seen: dict[str, int] = {}
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise TaskFileError(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(rec, dict):
            raise TaskFileError(f"{where}: a task is a JSON object, not {type(rec).__name__}")
        missing = [f for f in FIELDS if f not in rec]
        if missing:
            raise TaskFileError(f"{where}: missing fields {missing}; a task needs {', '.join(FIELDS)}")
        for f in ("instance_id", "repo", "base_commit", "problem_statement", "patch", "test_patch"):
            if not isinstance(rec[f], str):
                raise TaskFileError(f"{where}: {f} must be a string, not {type(rec[f]).__name__}")
        iid = rec["instance_id"]
        if iid in seen:
            raise TaskFileError(f"{where}: instance_id {iid!r} is also on line {seen[iid]}; ids must be unique")
        seen[iid] = n
        repo, repo_problem = resolve_repo(rec["repo"], path, repos, where)
        out.append(TaskRecord(
            instance_id=iid, repo=repo, repo_name=rec["repo"], repo_problem=repo_problem,
            base_commit=rec["base_commit"], problem_statement=rec["problem_statement"], patch=rec["patch"],
            test_patch=rec["test_patch"], fail_to_pass=_tests(rec["FAIL_TO_PASS"], "FAIL_TO_PASS", where),
            pass_to_pass=_tests(rec["PASS_TO_PASS"], "PASS_TO_PASS", where), recipe=_recipe(rec, where),
            extra={k: v for k, v in rec.items() if k not in FIELDS and k not in RECIPE_FIELDS}))
    if not out:
        raise TaskFileError(f"{path} holds no tasks")
    return out
