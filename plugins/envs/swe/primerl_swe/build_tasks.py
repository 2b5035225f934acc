"""Build the shipped SWE task set: one git repository per bug and a SWE-bench-format JSONL.

    python -m primerl_swe.build_tasks --out DIR      # DIR/tasks.jsonl, DIR/repos/<instance_id>/

Each repository holds ``pyutils`` (see :mod:`primerl_swe.taskset`) with one bug,
committed; the record's ``patch`` is the fix and ``test_patch`` the regression test, both
as ``git diff`` output against ``base_commit``. Commits are made with a fixed author and
date, so the same checkout always builds the same commits. ``primerl env check swe --tasks
DIR/tasks.jsonl --oracle`` verifies the set (reward 1 with the fix, 0 without).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

from primerl_swe.taskset import BUGS, LIBRARY

GIT_ENV = {"GIT_AUTHOR_NAME": "primerl", "GIT_AUTHOR_EMAIL": "primerl@example.invalid",
           "GIT_COMMITTER_NAME": "primerl", "GIT_COMMITTER_EMAIL": "primerl@example.invalid",
           "GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2026-01-01T00:00:00Z"}


def _git(args: list[str], cwd: Path) -> str:
    env = {**os.environ, **GIT_ENV}
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout


def existing_tests() -> list[str]:
    ids = []
    for path, text in sorted(LIBRARY.items()):
        if path.startswith("tests/test_"):
            ids += [f"{path}::{name}" for name in re.findall(r"^def (test_\w+)", text, re.M)]
    return ids


def build(out: Path) -> Path:
    """Write ``out/repos/*`` and ``out/tasks.jsonl``; returns the JSONL path."""
    out = Path(out)
    repos = out / "repos"
    shutil.rmtree(repos, ignore_errors=True)
    records = []
    for bug_id, file, correct, buggy, issue, test in BUGS:
        repo = repos / bug_id
        for path, text in LIBRARY.items():
            if path == file:
                if text.count(correct) != 1:
                    raise ValueError(f"{bug_id}: the fixed code must occur exactly once in {file}")
                text = text.replace(correct, buggy)
            (repo / path).parent.mkdir(parents=True, exist_ok=True)
            (repo / path).write_text(text)
        _git(["init", "--quiet", "--initial-branch=main"], repo)
        _git(["add", "-A"], repo)
        _git(["commit", "--quiet", "-m", f"pyutils ({bug_id})"], repo)
        base = _git(["rev-parse", "HEAD"], repo).strip()

        (repo / file).write_text(LIBRARY[file])
        patch = _git(["diff"], repo)
        _git(["checkout", "--quiet", "--", file], repo)
        test_file = f"tests/test_issue_{bug_id.replace('-', '_')}.py"
        (repo / test_file).write_text(test)
        _git(["add", "-N", test_file], repo)
        test_patch = _git(["diff"], repo)
        _git(["rm", "--quiet", "--cached", test_file], repo)
        (repo / test_file).unlink()

        records.append({
            "instance_id": f"pyutils__{bug_id}",
            "repo": str(repo.resolve()),
            "base_commit": base,
            "problem_statement": issue,
            "patch": patch,
            "test_patch": test_patch,
            "FAIL_TO_PASS": [f"{test_file}::{n}" for n in re.findall(r"^def (test_\w+)", test, re.M)],
            "PASS_TO_PASS": existing_tests(),
        })
    jsonl = out / "tasks.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records))
    return jsonl


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    path = build(ap.parse_args().out)
    print(f"wrote {sum(1 for _ in path.open())} tasks to {path}")


if __name__ == "__main__":
    main()
