"""Run model-written commands in a sandbox: bubblewrap plus resource limits.

What the sandbox guarantees (tested by trying each escape, see tests/envs/test_swe.py):

* no network: a fresh network namespace (``--unshare-all``), only an unconfigured loopback;
* no writes outside the scratch checkout: ``/`` is mounted read-only, ``/tmp`` is a private
  tmpfs, the checkout is the one writable bind mount (the interpreter's prefixes and
  ``ro_paths`` are bound read-only);
* no privileges: a user namespace with every capability dropped;
* limits: CPU seconds (RLIMIT_CPU), address space (RLIMIT_AS), open files, file size, and
  processes — a ``pids`` cgroup per run with ``pids.max`` where the cgroup hierarchy is
  writable (as root on CI), else RLIMIT_NPROC (binding for a non-root user); and a
  wall-clock timeout after which every process of the run is killed (the cgroup's
  members, and the sandbox's pid namespace dies with its init).

The interpreter running primerl is the one that runs the tests: its prefixes (``sys.prefix``,
``sys.base_prefix``, the exec prefixes, the directory of ``sys.executable`` and of its real
path, the directories on its ``sys.path``) are bound read-only *after* the private ``/tmp``,
so a virtual environment under ``/tmp``, or one layered over it, stays visible. Inside the sandbox ``python``/``python3`` are that interpreter and
its scripts directory (where ``pytest`` is) is on ``PATH``.

A run that could not start (bubblewrap's own error: no user namespaces, a bind source
missing) raises :class:`SandboxError` rather than returning a result: it is a harness
failure, never the command's. :func:`harness_problem` is the per-process probe that the
interpreter and pytest work inside the sandbox.

bubblewrap comes from the distribution (``apt-get install bubblewrap``; ``.ci/run`` installs
it). Without it, ``sandbox = "rlimit"`` runs commands with the same limits and user but no
filesystem or network isolation — for trusted tasks only, which is why it must be chosen
explicitly. ``sandbox = "auto"`` (the default) uses bubblewrap and fails with the fix when
it is missing (:class:`SandboxUnavailable`, a user error the CLI prints in one line).
"""

from __future__ import annotations

import os
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import uuid
from pathlib import Path

import attrs

from primerl.errors import PrimerlError

PIDS_CGROUP = Path("/sys/fs/cgroup/pids")


@attrs.frozen(kw_only=True)
class Limits:
    wall_s: float = 60.0
    cpu_s: int = 60
    memory_mb: int = 2048
    processes: int = 64
    file_mb: int = 64
    open_files: int = 256


@attrs.frozen
class Result:
    returncode: int
    output: str  # stdout and stderr, interleaved
    timed_out: bool = False

    def describe(self) -> str:
        head = "timed out" if self.timed_out else f"exit code {self.returncode}"
        return f"[{head}]\n{self.output}"


class SandboxUnavailable(PrimerlError, RuntimeError):
    """No sandbox of the kind asked for on this machine (bubblewrap is not installed)."""


class SandboxError(RuntimeError):
    """The sandbox could not start the command: a harness failure, not the command's."""


def bwrap_path() -> str | None:
    return shutil.which("bwrap")


def resolve(kind: str) -> str:
    """The sandbox to use for ``kind`` ("auto" | "bwrap" | "rlimit"), or an error naming the fix."""
    if kind not in ("auto", "bwrap", "rlimit"):
        raise ValueError(f"sandbox must be 'auto', 'bwrap' or 'rlimit', got {kind!r}")
    if kind == "rlimit":
        return kind
    if bwrap_path() is None:
        raise SandboxUnavailable(
            "the swe environment runs model-written code and needs bubblewrap, which is not on PATH: install it "
            "(`apt-get install bubblewrap`), or set --env.sandbox rlimit to run with resource limits "
            "only (no filesystem or network isolation; trusted tasks only)"
        )
    return "bwrap"


def python() -> str:
    """The interpreter that runs commands' ``python`` and the tests: the one running primerl."""
    return sys.executable


def interpreter_paths() -> list[str]:
    """What the running interpreter needs, wherever it lives: its prefixes, its scripts
    directory, the directory of ``sys.executable`` and of its real path, and every directory
    on its ``sys.path`` (site directories a ``.pth`` added: a venv layered over another one
    under ``/tmp``), symlinks resolved too, deduplicated, without ``/`` and without paths
    inside another one of the list."""
    exe = python()
    cands = [sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix, sysconfig.get_path("scripts"),
             os.path.dirname(exe), os.path.dirname(os.path.realpath(exe)), *(p for p in sys.path if p)]
    private = ("/tmp", os.path.realpath("/tmp"))  # never the private /tmp itself, nor what holds it
    paths = set()
    for c in cands:
        if c:
            for p in (os.path.abspath(c), os.path.realpath(c)):
                if os.path.isdir(p) and not any(t == p or t.startswith(p.rstrip("/") + "/") for t in private):
                    paths.add(p)
    return sorted(p for p in paths if not any(q != p and p.startswith(q.rstrip("/") + "/") for q in paths))


def _path_dirs() -> list[str]:
    exe = python()
    dirs = [os.path.dirname(exe), sysconfig.get_path("scripts") or "", "/usr/local/bin", "/usr/bin", "/bin"]
    return [d for i, d in enumerate(dirs) if d and d not in dirs[:i]]


# inside the sandbox only (its /tmp is private): ``python`` and ``python3`` for an interpreter
# whose directory may lack them (/usr/bin/python3). A virtual environment's bin directory
# has both, and they must be used as they are: Python finds its venv from the path it was
# started by, which a symlink elsewhere would lose.
SHIM_DIR = "/tmp/.primerl-bin"


def _in_venv() -> bool:
    return sys.prefix != sys.base_prefix


def _bwrap_argv(command: str, workdir: Path, env: dict[str, str], ro_paths: list[str], rw_paths: list[str],
                workdir_at: str, network: bool) -> list[str]:
    # mounts are applied in order; sorted by depth, a path inside another mount (the checkout
    # under a bound prefix, a prefix under /tmp) is mounted after it and stays as it should be
    mounts = [("--ro-bind", p, p) for p in [*interpreter_paths(), *ro_paths]]
    mounts += [("--bind", p, p) for p in rw_paths] + [("--bind", str(workdir), workdir_at)]
    mounts.sort(key=lambda m: len(Path(m[2]).parts))
    exe = python()
    return [bwrap_path(), "--ro-bind", "/", "/", "--tmpfs", "/tmp", "--dev", "/dev", "--proc", "/proc",
            *[a for m in mounts for a in m],
            *([] if _in_venv() else ["--symlink", exe, f"{SHIM_DIR}/python", "--symlink", exe, f"{SHIM_DIR}/python3"]),
            "--unshare-all", *(["--share-net"] if network else []), "--unshare-user", "--cap-drop", "ALL",
            "--die-with-parent", "--new-session",
            "--clearenv", *[a for k, v in env.items() for a in ("--setenv", k, v)],
            "--chdir", workdir_at, "--", "/bin/sh", "-c", command]


def _pids_cgroup(limit: int) -> Path | None:
    """A fresh pids cgroup with ``pids.max = limit``, or None where cgroups are not writable."""
    if os.getuid() != 0 or not os.access(PIDS_CGROUP, os.W_OK):
        return None
    cg = PIDS_CGROUP / f"primerl-sandbox-{uuid.uuid4().hex[:12]}"
    try:
        cg.mkdir()
        (cg / "pids.max").write_text(str(limit))
    except OSError:
        return None
    return cg


def _kill_cgroup(cg: Path) -> None:
    if not cg.exists():
        return
    for _ in range(100):  # processes may fork while we kill; pids.max bounds how many
        pids = [int(p) for p in (cg / "cgroup.procs").read_text().split()]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)
    for _ in range(50):  # killed processes leave the cgroup once reaped
        try:
            cg.rmdir()
            return
        except OSError:
            time.sleep(0.02)


def _limit(limits: Limits, cg: Path | None):
    def apply() -> None:
        os.setsid()
        if cg is not None:
            (cg / "cgroup.procs").write_text(str(os.getpid()))
        mb = 1 << 20
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_AS, (limits.memory_mb * mb, limits.memory_mb * mb))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_mb * mb, limits.file_mb * mb))
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits.open_files, limits.open_files))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if cg is None:
            resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))
    return apply


def run(command: str, workdir: Path, *, kind: str = "auto", limits: Limits = Limits(),
        ro_paths: list[str] = (), rw_paths: list[str] = (), workdir_at: str | None = None,
        path_first: list[str] = (), network: bool = False) -> Result:
    """Run ``command`` (a shell string) in ``workdir`` inside the sandbox. ``ro_paths`` and
    ``rw_paths`` are extra host paths made visible read-only / writable; ``workdir_at`` is
    where the sandbox sees ``workdir`` (bubblewrap only; default: its own path), so that an
    environment installed against that path works for every checkout; ``path_first`` goes
    before the interpreter on ``PATH``; ``network`` keeps the host's network (bubblewrap:
    for a task's install recipe, never for model-written code). Raises
    :class:`SandboxError` when the sandbox could not start the command (the command's own
    failures are in the result)."""
    kind = resolve(kind)
    workdir = Path(workdir).resolve()
    if kind != "bwrap" and workdir_at not in (None, str(workdir)):
        raise ValueError(f"the {kind} sandbox runs in place: it cannot show {workdir} at {workdir_at}")
    # the command may have chmod-ed its checkout; the sandbox must still be able to enter it
    mode = workdir.stat().st_mode
    if mode & 0o700 != 0o700:
        os.chmod(workdir, mode | 0o700)
    path = [*path_first, *([SHIM_DIR] if kind == "bwrap" and not _in_venv() else []), *_path_dirs()]
    env = {"PATH": ":".join(dict.fromkeys(path)), "HOME": "/tmp", "LANG": "C.UTF-8",
           "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1"}
    # the first line the shell prints is a fresh marker: output before it (or none) is the
    # sandbox's own, and a run without it never started the command
    marker = f"primerl-sandbox-started-{uuid.uuid4().hex}"
    script = f'echo {marker}; exec /bin/sh -c "$1"'
    if kind == "bwrap":
        argv = _bwrap_argv(script, workdir, env, [os.path.realpath(p) for p in ro_paths],
                           [os.path.realpath(p) for p in rw_paths], workdir_at or str(workdir), network)
        argv += ["sh", command]
    else:
        argv = ["/bin/sh", "-c", script, "sh", command]
    cg = _pids_cgroup(limits.processes)
    try:
        try:
            proc = subprocess.Popen(argv, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, preexec_fn=_limit(limits, cg))
        except (OSError, subprocess.SubprocessError) as e:
            raise SandboxError(f"the sandbox could not be started: {e}") from None
        try:
            out, _ = proc.communicate(timeout=limits.wall_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # bwrap's session; its pid namespace dies with it
            except ProcessLookupError:
                pass
            if cg is not None:
                _kill_cgroup(cg)
            out, _ = proc.communicate()
    finally:
        if cg is not None:
            _kill_cgroup(cg)  # nothing of the run outlives it (daemonised children included)
    text = out.decode("utf-8", "replace")
    at = text.find(marker + "\n")
    if at < 0:
        what = "timed out before starting the command" if timed_out else f"exited with code {proc.returncode}"
        raise SandboxError(f"the {kind} sandbox {what}: {_tail(text) or '(no output)'}")
    return Result(proc.returncode, text[:at] + text[at + len(marker) + 1:], timed_out)


def _tail(text: str, lines: int = 12, chars: int = 1200) -> str:
    """The end of an output, on one line (`` | `` between lines), for error messages."""
    kept = [ln.strip() for ln in text.strip().splitlines() if ln.strip()][-lines:]
    out = " | ".join(kept)
    return out if len(out) <= chars else "..." + out[-chars:]


# -- the harness probe: can the interpreter run pytest inside the sandbox? -----------------------

_probed: set[tuple[str, str]] = set()
_probe_lock = threading.Lock()
PROBE_OK = "primerl-probe-ok"


def harness_problem(kind: str = "auto") -> str | None:
    """None when the running interpreter imports pytest inside the ``kind`` sandbox, else
    the cause with its fix. A success is cached for the process; a failure is probed again
    next time (it may have been transient)."""
    kind = resolve(kind)
    key = (kind, python())
    if key in _probed:
        return None
    with _probe_lock:
        if key in _probed:
            return None
        exe = python()
        scratch = Path(tempfile.mkdtemp(prefix="primerl-probe-"))
        try:
            r = run(f"{shlex.quote(exe)} -c 'import pytest; print(\"{PROBE_OK}\")'", scratch, kind=kind,
                    limits=Limits(wall_s=60, cpu_s=60))
        except SandboxError as e:
            return str(e)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        if PROBE_OK in r.output:
            _probed.add(key)
            return None
        if "No module named pytest" in r.output or "No module named 'pytest'" in r.output:
            return (f"pytest is not installed in {exe}, the interpreter that runs the tests (the one running "
                    f"primerl): install it (`{exe} -m pip install pytest`)")
        return f"the interpreter {exe} does not run inside the {kind} sandbox: {_tail(r.describe())}"
