"""Scratch checkouts of task repositories, patches, and running the task's tests.

Git runs on the host (trusted: it only copies the task's own repository); everything the
repository's code does — its tests included — runs in the sandbox.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from primerl_swe import sandbox


class RepoError(RuntimeError):
    """A task whose repository, commit or patch is unusable."""


def git(args: list[str], cwd: Path, stdin: str | None = None) -> str:
    r = subprocess.run(["git", *args], cwd=cwd, input=stdin, capture_output=True, text=True)
    if r.returncode != 0:
        raise RepoError(f"git {' '.join(args)} failed in {cwd}: {r.stderr.strip() or r.stdout.strip()}")
    return r.stdout


def checkout(repo: str | Path, commit: str, parent: Path | None = None) -> Path:
    """A fresh scratch copy of ``repo`` at ``commit`` (no shared objects: the agent cannot
    touch the original)."""
    repo = Path(repo)
    if not (repo / ".git").exists() and not (repo / "HEAD").exists():
        raise RepoError(f"{repo} is not a git repository")
    work = Path(tempfile.mkdtemp(prefix="primerl-swe-", dir=parent))
    git(["clone", "--quiet", "--no-hardlinks", "--no-checkout", str(repo.resolve()), str(work)], cwd=work.parent)
    git(["-c", "advice.detachedHead=false", "checkout", "--quiet", commit], cwd=work)
    return work


def apply_patch(work: Path, patch: str) -> None:
    if not patch.strip():
        return
    git(["apply", "--whitespace=nowarn", "-"], cwd=work, stdin=patch)


def diff(work: Path) -> str:
    """The agent's changes so far (tracked and new files), as a patch."""
    git(["add", "-A"], cwd=work)
    return git(["diff", "--cached"], cwd=work)


def remove(work: Path) -> None:
    shutil.rmtree(work, ignore_errors=True)


_OUTCOME = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+)", re.M)


def run_tests(work: Path, node_ids: list[str], *, kind: str = "auto",
              limits: sandbox.Limits = sandbox.Limits(wall_s=120)) -> tuple[dict[str, str], sandbox.Result]:
    """Run pytest node ids in the sandbox. Returns ({node id: outcome}, the raw result);
    a test that did not report (collection error, timeout) is absent from the map."""
    if not node_ids:
        return {}, sandbox.Result(0, "")
    args = " ".join(f"'{n}'" for n in node_ids)
    cmd = f"python -m pytest -rA -q -p no:cacheprovider --no-header {args}"
    result = sandbox.run(cmd, work, kind=kind, limits=limits)
    return {m.group(2): m.group(1) for m in _OUTCOME.finditer(result.output)}, result


def all_pass(work: Path, node_ids: list[str], *, kind: str = "auto") -> bool:
    outcomes, _ = run_tests(work, node_ids, kind=kind)
    return all(outcomes.get(n) == "PASSED" for n in node_ids)
