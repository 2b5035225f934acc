"""Run model-written commands in a sandbox: bubblewrap plus resource limits.

What the sandbox guarantees (tested by trying each escape, see tests/envs/test_swe.py):

* no network: a fresh network namespace (``--unshare-all``), only an unconfigured loopback;
* no writes outside the scratch checkout: ``/`` is mounted read-only, ``/tmp`` is a private
  tmpfs, the checkout is the one writable bind mount;
* no privileges: a user namespace with every capability dropped;
* limits: CPU seconds (RLIMIT_CPU), address space (RLIMIT_AS), open files, file size, and
  processes — a ``pids`` cgroup per run with ``pids.max`` where the cgroup hierarchy is
  writable (as root on CI), else RLIMIT_NPROC (binding for a non-root user); and a
  wall-clock timeout after which every process of the run is killed (the cgroup's
  members, and the sandbox's pid namespace dies with its init).

bubblewrap comes from the distribution (``apt-get install bubblewrap``; ``.ci/run`` installs
it). Without it, ``sandbox = "rlimit"`` runs commands with the same limits and user but no
filesystem or network isolation — for trusted tasks only, which is why it must be chosen
explicitly. ``sandbox = "auto"`` (the default) uses bubblewrap and fails with the fix when
it is missing.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import attrs

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


def bwrap_path() -> str | None:
    return shutil.which("bwrap")


def resolve(kind: str) -> str:
    """The sandbox to use for ``kind`` ("auto" | "bwrap" | "rlimit"), or an error naming the fix."""
    if kind not in ("auto", "bwrap", "rlimit"):
        raise ValueError(f"sandbox must be 'auto', 'bwrap' or 'rlimit', got {kind!r}")
    if kind == "rlimit":
        return kind
    if bwrap_path() is None:
        raise RuntimeError(
            "the swe environment runs model-written code and needs bubblewrap: install it "
            "(`apt-get install bubblewrap`), or set --env.sandbox rlimit to run with resource limits "
            "only (no filesystem or network isolation; trusted tasks only)"
        )
    return "bwrap"


def _pids_cgroup(limit: int) -> Path | None:
    """A fresh pids cgroup with ``pids.max = limit``, or None where cgroups are not writable."""
    import uuid

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


def run(command: str, workdir: Path, *, kind: str = "auto", limits: Limits = Limits()) -> Result:
    """Run ``command`` (a shell string) in ``workdir`` inside the sandbox."""
    kind = resolve(kind)
    workdir = Path(workdir).resolve()
    # the interpreter running primerl (and its pytest) comes first on PATH
    env = {"PATH": f"{os.path.dirname(sys.executable)}:/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8",
           "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1"}
    if kind == "bwrap":
        argv = [bwrap_path(), "--ro-bind", "/", "/", "--tmpfs", "/tmp", "--bind", str(workdir), str(workdir),
                "--dev", "/dev", "--proc", "/proc", "--unshare-all", "--unshare-user", "--cap-drop", "ALL",
                "--die-with-parent", "--new-session",
                "--clearenv", *[a for k, v in env.items() for a in ("--setenv", k, v)],
                "--chdir", str(workdir), "--", "/bin/sh", "-c", command]
    else:
        argv = ["/bin/sh", "-c", command]
    cg = _pids_cgroup(limits.processes)
    try:
        proc = subprocess.Popen(argv, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, preexec_fn=_limit(limits, cg))
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
    return Result(proc.returncode, out.decode("utf-8", "replace"), timed_out)
