"""Scratch checkouts of task repositories, patches, and running the task's tests.

Git runs on the host; everything the repository's code does — its tests included — runs in
the sandbox. A scratch checkout keeps its git directory *outside* the working tree
(``<work>.git``, next to it): the agent's commands can write anything in the working tree,
a ``.git`` included, and host git must never read a configuration the model wrote (a
``core.fsmonitor`` or hook there would run on the host). :func:`wgit` therefore always
names the git directory and the working tree explicitly. Inside the sandbox the git
directory is visible read-only (``git diff``/``log``/``status`` work, commits do not).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

from primerl.errors import PrimerlError
from primerl_swe import sandbox


class RepoError(RuntimeError):
    """A task whose repository, commit or patch is unusable (or a checkout the agent broke)."""


class GitUnavailable(PrimerlError):
    """git is not installed: no task can be checked out."""


def require_git() -> None:
    if shutil.which("git") is None:
        raise GitUnavailable("the swe environment checks out each task with git, which is not on PATH: "
                             "install it (`apt-get install git`)")


# belt and braces: the git directory's configuration is primerl's own, but nothing a
# checkout's git call does should ever start a program
_SAFE = ["-c", "core.fsmonitor=false", "-c", "core.hooksPath=/dev/null"]


def git(args: list[str], cwd: Path, stdin: str | None = None) -> str:
    """git on a repository primerl trusts (the task's own)."""
    try:
        r = subprocess.run(["git", *args], cwd=cwd, input=stdin, capture_output=True, text=True)
    except OSError as e:  # git missing, cwd gone
        raise RepoError(f"git {' '.join(args)} could not run in {cwd}: {e}") from None
    if r.returncode != 0:
        raise RepoError(f"git {' '.join(args)} failed in {cwd}: {r.stderr.strip() or r.stdout.strip()}")
    return r.stdout


def git_dir(work: Path) -> Path:
    """The git directory of a scratch checkout (outside its working tree)."""
    work = Path(work)
    return work.with_name(work.name + ".git")


def wgit(work: Path, args: list[str], stdin: str | None = None) -> str:
    """git on a scratch checkout: its own git directory, never one found in the working tree."""
    work = Path(work)
    try:
        return git(["--git-dir", str(git_dir(work)), "--work-tree", str(work), *_SAFE, *args], work, stdin)
    except RepoError as e:
        raise RepoError(str(e).replace(f"--git-dir {git_dir(work)} --work-tree {work} {' '.join(_SAFE)} ", "")) from None


def checkout(repo: str | Path, commit: str, parent: Path | None = None) -> Path:
    """A fresh scratch copy of ``repo`` at ``commit`` (no shared objects: the agent cannot
    touch the original)."""
    repo = Path(repo)
    if not repo.is_dir() or (not (repo / ".git").exists() and not (repo / "HEAD").exists()):
        raise RepoError(f"{repo} is not a git repository")
    work = Path(tempfile.mkdtemp(prefix="primerl-swe-", dir=parent))
    try:
        git(["clone", "--quiet", "--no-hardlinks", "--no-checkout", "--separate-git-dir", str(git_dir(work)),
             str(repo.resolve()), str(work)], cwd=work.parent)
        wgit(work, ["-c", "advice.detachedHead=false", "checkout", "--quiet", commit])
    except RepoError:
        remove(work)
        raise
    return work


def apply_patch(work: Path, patch: str) -> None:
    if not patch.strip():
        return
    wgit(work, ["apply", "--whitespace=nowarn", "-"], stdin=patch)


def reset_files(work: Path, commit: str, files: list[str]) -> None:
    """Put ``files`` back as they are at ``commit`` (removed where they do not exist there).
    Never follows a symlink the agent planted: a path leading outside the checkout is an error."""
    root = os.path.realpath(work)
    for f in files:
        parent = os.path.realpath(os.path.join(root, os.path.dirname(f)))
        if parent != root and not parent.startswith(root + os.sep):
            raise RepoError(f"{f} leads outside the checkout (through a symlink)")
        if wgit(work, ["ls-tree", "--name-only", commit, "--", f]).strip():
            wgit(work, ["checkout", commit, "--", f])
        else:
            p = Path(parent) / os.path.basename(f)
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink(missing_ok=True)


def diff(work: Path) -> str:
    """The agent's changes so far (tracked and new files), as a patch."""
    wgit(work, ["add", "-A"])
    return wgit(work, ["diff", "--cached"])


def remove(work: Path) -> None:
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(git_dir(work), ignore_errors=True)


TEST_LIMITS = sandbox.Limits(wall_s=120)
COMMAND_LIMITS = sandbox.Limits()
_OUTCOME = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+)", re.M)


def pytest_command(args: str = "") -> str:
    """pytest of the interpreter running primerl (not whatever ``python`` is on PATH)."""
    return f"{shlex.quote(sandbox.python())} -m pytest -p no:cacheprovider {args}".strip()


def run_tests(work: Path, node_ids: list[str], *, kind: str = "auto",
              limits: sandbox.Limits = TEST_LIMITS) -> tuple[dict[str, str], sandbox.Result]:
    """Run pytest node ids in the sandbox. Returns ({node id: outcome}, the raw result);
    a test that did not report (collection error, timeout) is absent from the map. A module
    that fails to collect does not stop the others (``--continue-on-collection-errors``).
    Raises :class:`sandbox.SandboxError` when the sandbox could not start."""
    if not node_ids:
        return {}, sandbox.Result(0, "")
    args = " ".join(shlex.quote(n) for n in node_ids)
    cmd = pytest_command(f"-rA -q --no-header --continue-on-collection-errors {args}")
    result = sandbox.run(cmd, work, kind=kind, limits=limits, ro_paths=_ro_paths(work))
    return {m.group(2): m.group(1) for m in _OUTCOME.finditer(result.output)}, result


def _ro_paths(work: Path) -> list[str]:
    g = git_dir(work)
    return [str(g)] if g.is_dir() else []


def run(command: str, work: Path, *, kind: str = "auto", limits: sandbox.Limits = COMMAND_LIMITS) -> sandbox.Result:
    """A shell command in the sandbox, in a scratch checkout (its git directory visible read-only)."""
    return sandbox.run(command, work, kind=kind, limits=limits, ro_paths=_ro_paths(work))


def all_pass(work: Path, node_ids: list[str], *, kind: str = "auto") -> bool:
    outcomes, _ = run_tests(work, node_ids, kind=kind)
    return all(outcomes.get(n) == "PASSED" for n in node_ids)
