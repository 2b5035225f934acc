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

import json
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import attrs

from primerl.errors import PrimerlError
from primerl_swe import sandbox, testenv


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
PASSING = ("PASSED", "XFAIL")  # SWE-bench's rule: an expected failure counts as passing


@attrs.frozen
class Report:
    """What :mod:`primerl_swe.pytest_report` wrote about one pytest run."""

    outcomes: dict[str, str] = attrs.Factory(dict)  # node id -> PASSED | FAILED | ERROR | SKIPPED | XFAIL | XPASS
    collected: tuple[str, ...] = ()
    collect_errors: tuple[dict[str, str], ...] = ()  # {"nodeid", "message"}
    from_checkout: tuple[str, ...] = ()  # top-level modules imported from the checkout
    shadowed: dict[str, str] = attrs.Factory(dict)  # module -> the file outside the checkout it came from
    written: bool = False  # False: the run ended before pytest wrote its report

    def passed(self, node_id: str) -> bool:
        return self.outcomes.get(node_id) in PASSING


def test_files(node_ids: list[str]) -> list[str]:
    """The files holding the node ids, in order (pytest runs these, as SWE-bench's harness does)."""
    return list(dict.fromkeys(n.split("::")[0] for n in node_ids))


def pytest_argv(env: testenv.TestEnv, test_cmd: str = "pytest") -> list[str]:
    """``test_cmd`` with its pytest run by the task environment's python."""
    words = shlex.split(test_cmd)
    if words[:1] in (["pytest"], ["py.test"]):
        words = words[1:]
    elif words[1:3] == ["-m", "pytest"]:
        words = words[3:]
    return [env.python, "-m", "pytest", "-p", "no:cacheprovider", *words]


def run_tests(work: Path, node_ids: list[str], *, env: testenv.TestEnv, kind: str = "auto",
              limits: sandbox.Limits = TEST_LIMITS, test_cmd: str = "pytest", modules: tuple[str, ...] = (),
              collect_only: bool = False) -> tuple[Report, sandbox.Result]:
    """Run the files of ``node_ids`` with pytest in the sandbox, in the task's environment;
    returns the structured report and the raw result. A module that fails to collect does not
    stop the others. ``modules`` must be imported from the checkout (else they are reported
    ``shadowed``). Raises :class:`sandbox.SandboxError` when the sandbox could not start."""
    if not node_ids:
        return Report(written=True), sandbox.Result(0, "")
    reports = Path(tempfile.mkdtemp(prefix="primerl-report-", dir=work.parent))
    try:
        out = reports / "report.json"
        argv = [*pytest_argv(env, test_cmd), "-p", testenv.REPORT_PLUGIN, f"--primerl-report={out}",
                f"--primerl-checkout={env.checkout_at}", f"--rootdir={env.checkout_at}",
                "--continue-on-collection-errors", *([f"--primerl-modules={','.join(modules)}"] if modules else []),
                *(["--collect-only", "-q"] if collect_only else []), *test_files(node_ids)]
        result = sandbox.run(shlex.join(argv), work, kind=kind, limits=limits, ro_paths=[*_ro_paths(work), str(env.root)],
                             rw_paths=[str(reports)], workdir_at=env.checkout_at, path_first=[str(env.bin)])
        return _read_report(out), result
    finally:
        shutil.rmtree(reports, ignore_errors=True)


def _read_report(path: Path) -> Report:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return Report()
    if not isinstance(data, dict):
        return Report()
    return Report(outcomes={str(k): str(v) for k, v in dict(data.get("outcomes", {})).items()},
                  collected=tuple(data.get("collected", ())), collect_errors=tuple(data.get("collect_errors", ())),
                  from_checkout=tuple(data.get("from_checkout", ())), shadowed=dict(data.get("shadowed", {})),
                  written=True)


def _ro_paths(work: Path) -> list[str]:
    g = git_dir(work)
    return [str(g)] if g.is_dir() else []


def run(command: str, work: Path, *, env: testenv.TestEnv, kind: str = "auto",
        limits: sandbox.Limits = COMMAND_LIMITS) -> sandbox.Result:
    """A shell command in the sandbox, in a scratch checkout (its git directory visible
    read-only), with the task's environment first on ``PATH``."""
    return sandbox.run(command, work, kind=kind, limits=limits, ro_paths=[*_ro_paths(work), str(env.root)],
                       workdir_at=env.checkout_at, path_first=[str(env.bin)])
