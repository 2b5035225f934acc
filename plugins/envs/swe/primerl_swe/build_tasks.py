"""Build the shipped SWE task sets: git repositories and a SWE-bench-format JSONL.

    python -m primerl_swe.build_tasks --out DIR                  # pyutils: DIR/tasks.jsonl, DIR/repos/<id>/
    python -m primerl_swe.build_tasks --set layouts --out DIR    # DIR/tasks.jsonl, DIR/fixtures/<name>/, DIR/dists/

``pyutils`` (:mod:`primerl_swe.taskset`): one repository per bug, each holding the library
with that bug committed. ``layouts`` (:mod:`primerl_swe.layouts`): one repository per
library with a history (the library's release, then a branch per bug), rows in SWE-bench's
exact shape (``repo`` as ``owner/name``, found beside the file or under ``--env.repos``),
and the fixed release of ``semverlite`` as a wheel in ``DIR/dists``. Every record's
``patch`` is the fix and its ``test_patch`` the regression test, both as ``git diff``
output against ``base_commit``. Commits are made with a fixed author and date, so the same
checkout always builds the same commits. ``primerl env check swe --tasks DIR/tasks.jsonl
--oracle`` verifies a set (reward 1 with the fix, 0 without).

Without ``--env.tasks`` the swe environment builds the set named by ``--env.taskset`` on
first use, once, into ``<cache_dir>/tasks/<set>-<digest>/`` (:func:`shipped`).
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from primerl_swe import layouts
from primerl_swe.taskset import BUGS, LIBRARY

GIT_ENV = {"GIT_AUTHOR_NAME": "primerl", "GIT_AUTHOR_EMAIL": "primerl@example.invalid",
           "GIT_COMMITTER_NAME": "primerl", "GIT_COMMITTER_EMAIL": "primerl@example.invalid",
           "GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2026-01-01T00:00:00Z"}


def _git(args: list[str], cwd: Path) -> str:
    env = {**os.environ, **GIT_ENV}
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout


def _write(root: Path, files: dict[str, str]) -> None:
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)


def _test_names(text: str) -> list[str]:
    return re.findall(r"^def (test_\w+)", text, re.M)


def existing_tests() -> list[str]:
    ids = []
    for path, text in sorted(LIBRARY.items()):
        if path.startswith("tests/test_"):
            ids += [f"{path}::{name}" for name in _test_names(text)]
    return ids


def _patches(repo: Path, file: str, fixed: str, bug_id: str, test: str) -> tuple[str, str, str]:
    """On a clean checkout of the buggy commit: (patch, test_patch, the test file's path)."""
    (repo / file).write_text(fixed)
    patch = _git(["diff"], repo)
    _git(["checkout", "--quiet", "--", file], repo)
    test_file = f"tests/test_issue_{bug_id.replace('-', '_')}.py"
    (repo / test_file).write_text(test)
    _git(["add", "-N", test_file], repo)
    test_patch = _git(["diff"], repo)
    _git(["rm", "--quiet", "--cached", test_file], repo)
    (repo / test_file).unlink()
    return patch, test_patch, test_file


def _buggy(files: dict[str, str], file: str, correct: str, buggy: str, bug_id: str) -> str:
    if files[file].count(correct) != 1:
        raise ValueError(f"{bug_id}: the fixed code must occur exactly once in {file}")
    return files[file].replace(correct, buggy)


def _write_jsonl(path: Path, rows: list[dict[str, Any]], ensure_ascii: bool = True) -> Path:
    """The task file, written last and atomically: its presence says the set is complete."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=ensure_ascii) + "\n" for r in rows), encoding="utf-8")
    os.replace(tmp, path)
    return path


def build(out: Path) -> Path:
    """The pyutils set: ``out/repos/*`` and ``out/tasks.jsonl``; returns the JSONL path."""
    out = Path(out)
    repos = out / "repos"
    shutil.rmtree(repos, ignore_errors=True)
    records = []
    for bug_id, file, correct, buggy, issue, test in BUGS:
        repo = repos / bug_id
        _write(repo, {**LIBRARY, file: _buggy(LIBRARY, file, correct, buggy, bug_id)})
        _git(["init", "--quiet", "--initial-branch=main"], repo)
        _git(["add", "-A"], repo)
        _git(["commit", "--quiet", "-m", f"pyutils ({bug_id})"], repo)
        base = _git(["rev-parse", "HEAD"], repo).strip()
        patch, test_patch, test_file = _patches(repo, file, LIBRARY[file], bug_id, test)
        records.append({
            "instance_id": f"pyutils__{bug_id}",
            "repo": str(repo.resolve()),
            "base_commit": base,
            "problem_statement": issue,
            "patch": patch,
            "test_patch": test_patch,
            "FAIL_TO_PASS": [f"{test_file}::{n}" for n in _test_names(test)],
            "PASS_TO_PASS": existing_tests(),
        })
    return _write_jsonl(out / "tasks.jsonl", records)


def _build_library(lib: layouts.Library, out: Path) -> list[dict[str, Any]]:
    """One repository with a history (the release on ``main``, a branch per bug); its rows."""
    repo = out / lib.owner / lib.name
    shutil.rmtree(repo, ignore_errors=True)
    _write(repo, lib.files)
    _git(["init", "--quiet", "--initial-branch=main"], repo)
    _git(["add", "-A"], repo)
    _git(["commit", "--quiet", "-m", f"{lib.name} {lib.version}"], repo)
    release = _git(["rev-parse", "HEAD"], repo).strip()
    rows = []
    for bug in lib.bugs:
        _git(["checkout", "--quiet", "-b", f"bug/{bug.id}", release], repo)
        (repo / bug.file).write_text(_buggy(lib.files, bug.file, bug.correct, bug.buggy, bug.id))
        _git(["commit", "--quiet", "-am", f"{bug.file}: rework"], repo)
        base = _git(["rev-parse", "HEAD"], repo).strip()
        patch, test_patch, test_file = _patches(repo, bug.file, lib.files[bug.file], bug.id, bug.test)
        f2p = list(bug.fail_to_pass) or [f"{test_file}::{n}" for n in _test_names(bug.test)]
        rows.append({  # SWE-bench's shape: owner/name, test lists as JSON strings, its extra fields
            "repo": lib.repo, "instance_id": f"{lib.owner}__{lib.name}-{bug.id}", "base_commit": base,
            "patch": patch, "test_patch": test_patch, "problem_statement": bug.issue, "hints_text": "",
            "created_at": GIT_ENV["GIT_AUTHOR_DATE"], "version": lib.version, "environment_setup_commit": release,
            "FAIL_TO_PASS": json.dumps(f2p), "PASS_TO_PASS": json.dumps(list(lib.existing_tests)),
        })
    _git(["checkout", "--quiet", "main"], repo)
    return rows


def _fixed_wheel(lib: layouts.Library, dists: Path) -> Path:
    """The library's next minor release (every fix in) built as a wheel, locally, no network."""
    major, minor, _ = lib.version.split(".")
    version = f"{major}.{int(minor) + 1}.0"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / lib.name
        _write(src, {**lib.files, "pyproject.toml": lib.files["pyproject.toml"].replace(
            f'version = "{lib.version}"', f'version = "{version}"')})
        dists.mkdir(parents=True, exist_ok=True)
        r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                            "--disable-pip-version-check", "-q", "-w", str(dists), str(src)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"building the {lib.name} {version} wheel failed: {r.stderr.strip()[-800:]}")
    (wheel,) = dists.glob(f"{lib.name}-{version}-*.whl")
    return wheel


def build_layouts(out: Path) -> Path:
    """The layouts set: ``out/<owner>/<name>/``, ``out/dists/*.whl``, ``out/tasks.jsonl``."""
    out = Path(out)
    rows = [row for lib in layouts.LIBRARIES for row in _build_library(lib, out)]
    shutil.rmtree(out / "dists", ignore_errors=True)
    for lib in layouts.LIBRARIES:
        if lib.wheel:
            _fixed_wheel(lib, out / "dists")
    # JSON Lines as SWE-bench exports them: UTF-8, non-ASCII text as it is (U+2028 included)
    return _write_jsonl(out / "tasks.jsonl", rows, ensure_ascii=False)


SETS: dict[str, Callable[[Path], Path]] = {"pyutils": build, "layouts": build_layouts}


def _digest(name: str) -> str:
    """Changes whenever what the set is built from changes (a newer primerl rebuilds it)."""
    here = Path(__file__).parent
    sources = ["build_tasks.py", "taskset.py" if name == "pyutils" else "layouts.py"]
    return hashlib.sha256(b"".join((here / s).read_bytes() for s in sources)).hexdigest()[:12]


def shipped(name: str, root: Path, log: Callable[[str], None] = print) -> Path:
    """The tasks.jsonl of shipped set ``name`` under ``root``, built the first time (once,
    under a file lock, so concurrent processes wait for the first)."""
    if name not in SETS:
        raise ValueError(f"no shipped task set {name!r}; sets: {', '.join(SETS)}")
    out = Path(root).expanduser() / f"{name}-{_digest(name)}"
    jsonl = out / "tasks.jsonl"
    if jsonl.is_file():
        return jsonl
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f"{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not jsonl.is_file():  # tasks.jsonl is written last: a folder without it is a build cut short
            log(f"building the shipped task set '{name}' into {out} (first use)")
            shutil.rmtree(out, ignore_errors=True)
            SETS[name](out)
    return jsonl


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--set", choices=sorted(SETS), default="pyutils", help="which shipped set (default pyutils)")
    args = ap.parse_args()
    path = SETS[args.set](args.out)
    print(f"wrote {sum(1 for _ in path.open())} tasks to {path}")


if __name__ == "__main__":
    main()
