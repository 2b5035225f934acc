"""A task's own Python environment: the checkout installed, layered over the running interpreter.

The tests of a task must import the code *in the checkout*, whatever its layout (a package
at the root, under ``src/``, wherever ``pyproject.toml`` or ``setup.py`` puts it) and even
where the same distribution is installed in the interpreter running primerl. So every task
gets a virtual environment of its own, made the way the ecosystem installs a project for
development:

* ``python -m venv`` from the running interpreter, with a ``.pth`` file that adds the running
  interpreter's site directories (``site.getsitepackages()``, the user site) *after* its own:
  pytest, the task's dependencies and the build backends come from primerl's environment,
  nothing is copied;
* then, inside the sandbox with the checkout mounted at :data:`TESTBED`, the task's recipe:
  ``pre_install`` commands, the ``install`` command (default: the standard editable install,
  PEP 660, with the project's own build backend from primerl's environment, as ``pip install
  --no-deps --no-build-isolation -e .`` does it; no network: :mod:`primerl_swe.editable_install`),
  and ``pip_packages``. An editable install
  puts the checkout's import root on ``sys.path`` (or its import finder on ``sys.meta_path``)
  ahead of the layered site directories, so an installed copy of the same distribution never
  shadows it. A checkout that declares no project
  (no ``pyproject.toml`` ``[project]``/``[build-system]``, ``setup.py`` or ``setup.cfg``) is
  not installed: its tests import it from the checkout's root, where pytest runs.

Every episode's fresh checkout is mounted at the same :data:`TESTBED` path, so one
environment serves every episode of the task: it is made on the task's first episode and
cached under ``<cache_dir>/envs/``, keyed by the repository, the base commit, the recipe and
the interpreter (a file lock makes concurrent env workers build it once). What the recipe
leaves in the checkout it ran on (files the build writes into the tree: a ``version-file``,
generated modules; ``pre_install`` edits) is recorded with the environment and laid into
every episode's checkout (:mod:`primerl_swe.generated`, :meth:`TestEnv.lay_into`). The
``rlimit`` sandbox cannot mount, so there the environment is made per checkout, in place.

Recipes that need the registry (``pip_packages``, an ``install`` with dependencies) are run
once with the network on (``primerl env prepare swe``), and the run reuses their cache.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shlex
import shutil
import site
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs

from primerl_swe import generated, sandbox
from primerl_swe.records import TaskRecord

TESTBED = "/tmp/testbed"  # where the sandbox shows every checkout (bubblewrap)
FORMAT = 2  # bump when the layout of an environment changes: older ones are rebuilt
READY = ".primerl-env.json"
WRITTEN = "written"  # in an environment: copies of what its recipe left in the checkout (primerl_swe.generated)
INSTALL_LOG = "install.log"  # in an environment: each recipe command and its output
# copied into each environment (its site-packages): the harness's pytest plugin and its
# editable installer, so the sandbox needs nothing of primerl's own installation
REPORT_PLUGIN = "primerl_swe_report"
INSTALLER = "primerl_swe_editable"
_COPIED = {REPORT_PLUGIN: Path(__file__).with_name("pytest_report.py"),
           INSTALLER: Path(__file__).with_name("editable_install.py")}
DEFAULT_INSTALL = f"python -m {INSTALLER}"  # PEP 660 with the project's backend (what pip -e does, faster)


class SetupFailed(RuntimeError):
    """The task's environment could not be made (the message holds the command and its output)."""


@attrs.frozen
class TestEnv:
    """A made environment: its root, and where it expects the checkout."""

    root: Path
    checkout_at: str  # TESTBED, or (rlimit) the checkout's own path
    setup_s: float = 0.0  # how long making it took (0 when it came from the cache)
    installed: bool = True  # False: the checkout declares no project, nothing was installed
    # what the recipe left in the checkout it was made on, laid into every episode's checkout
    written: generated.Written = generated.Written()

    @property
    def bin(self) -> Path:
        return self.root / "bin"

    @property
    def python(self) -> str:
        return str(self.bin / "python")

    def lay_into(self, checkout: Path) -> None:
        """Put what the recipe left in the checkout the environment was made on (the files its
        build wrote, its edits) into ``checkout``, a fresh one at the same commit."""
        generated.lay(self.written, self.root / WRITTEN, checkout)


def layered_site_dirs() -> list[str]:
    """The running interpreter's site directories, in its order (what the layer adds)."""
    dirs = list(site.getsitepackages()) if not sys.flags.no_site else []
    if site.ENABLE_USER_SITE and os.path.isdir(site.getusersitepackages()):
        dirs.append(site.getusersitepackages())
    return [d for d in dict.fromkeys(os.path.realpath(d) for d in dirs) if os.path.isdir(d)]


def _site_packages(root: Path) -> Path:
    v = sys.version_info
    return root / "lib" / f"python{v.major}.{v.minor}" / "site-packages"


_WRAPPER = "#!{python}\nimport sys\nfrom {module} import {func}\nsys.exit({func}())\n"


def make_layered_venv(root: Path, site_dirs: list[str] | None = None) -> Path:
    """A virtual environment at ``root`` that sees its own site-packages first, then the
    running interpreter's (``site_dirs``); ``python``, ``pip`` and ``pytest`` in its ``bin``
    run inside it. Returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, capture_output=True)
    sp = _site_packages(root)
    dirs = layered_site_dirs() if site_dirs is None else site_dirs
    # .pth files run in name order once the venv's own site-packages joined sys.path; "~" sorts
    # after the editable installs' files, so when this one runs their paths are on sys.path and
    # their import finders on sys.meta_path. Finders an editable install appended (setuptools',
    # hatchling's `editables`) answer only for the project's own packages: they move ahead of
    # the path finder, then the running interpreter's site directories join sys.path after.
    (sp / "~primerl-layer.pth").write_text(
        "import site, sys; from importlib.machinery import PathFinder; m = sys.meta_path; "
        "k = m.index(PathFinder) if PathFinder in m else len(m); m[k:] = [*m[k + 1:], *m[k:k + 1]]; "
        + "; ".join(f"site.addsitedir({d!r})" for d in dirs) + "\n")
    py = root / "bin" / "python"
    for name, module, func in (("pip", "pip._internal.cli.main", "main"), ("pip3", "pip._internal.cli.main", "main"),
                               ("pytest", "pytest", "console_main"), ("py.test", "pytest", "console_main")):
        script = root / "bin" / name
        script.write_text(_WRAPPER.format(python=py, module=module, func=func))
        script.chmod(0o755)
    return py


def declares_project(checkout: Path) -> bool:
    """Whether the checkout is a Python project pip can install (else nothing is installed)."""
    if (checkout / "setup.py").is_file():
        return True
    cfg = checkout / "setup.cfg"
    if cfg.is_file() and "[metadata]" in cfg.read_text(errors="replace"):
        return True
    pyproject = checkout / "pyproject.toml"
    if pyproject.is_file():
        try:
            import tomllib
        except ImportError:  # Python 3.10
            import tomli as tomllib
        try:
            data = tomllib.loads(pyproject.read_text(errors="replace"))
        except ValueError:
            return True  # pip says what is wrong with it
        return "project" in data or "build-system" in data or "poetry" in data.get("tool", {})
    return False


def env_key(rec: TaskRecord) -> dict[str, Any]:
    return {"format": FORMAT, "repo": str(rec.repo), "base_commit": rec.base_commit, "recipe": rec.recipe.key(),
            "python": os.path.realpath(sys.executable), "version": sys.version, "layer": layered_site_dirs(),
            "copied": hashlib.sha256(b"".join(p.read_bytes() for p in _COPIED.values())).hexdigest()[:16]}


def env_dir(cache_dir: Path, rec: TaskRecord) -> Path:
    digest = hashlib.sha256(json.dumps(env_key(rec), sort_keys=True).encode()).hexdigest()[:16]
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in rec.repo.name)[:40]
    return Path(cache_dir) / "envs" / f"{name}-{rec.base_commit[:12]}-{digest}"


@contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _backend_hint(output: str) -> str:
    for needle in ("Cannot import '", "No module named '"):
        at = output.find(needle)
        if at >= 0:
            module = output[at + len(needle):].split("'")[0].split(".")[0]
            if module and module != "pip":
                return (f"; the build backend or a module it needs ({module}) is not installed in "
                        f"{sys.executable}: install it there (`{sys.executable} -m pip install {module}`), "
                        "or give the task an `install` recipe")
    if "No module named pip" in output:
        return f"; pip is not installed in {sys.executable} (`{sys.executable} -m ensurepip`)"
    return ""


def _install(env: TestEnv, checkout: Path, rec: TaskRecord, *, kind: str, network: bool, git_dir: Path | None,
             timeout_s: float) -> bool:
    """Run the recipe in the sandbox; returns whether anything was installed."""
    r = rec.recipe
    steps = list(r.pre_install)
    installed = r.install is not None or declares_project(checkout)
    if r.install is not None:
        steps.append(r.install)
    elif installed:
        steps.append(DEFAULT_INSTALL)
    if r.pip_packages:
        steps.append("python -m pip install --disable-pip-version-check -q " + " ".join(map(shlex.quote, r.pip_packages)))
    limits = sandbox.Limits(wall_s=timeout_s, cpu_s=int(timeout_s), memory_mb=4096, processes=256, file_mb=1024)
    for step in steps:
        result = sandbox.run(step, checkout, kind=kind, limits=limits, ro_paths=[str(git_dir)] if git_dir else [],
                             rw_paths=[str(env.root)], workdir_at=env.checkout_at, path_first=[str(env.bin)],
                             network=network)
        with open(env.root / INSTALL_LOG, "a") as log:
            log.write(f"$ {step}\n{result.output}\n")
        if result.returncode != 0 or result.timed_out:
            why = "timed out" if result.timed_out else f"exit code {result.returncode}"
            net = "" if network else (" (no network: a recipe that downloads needs `primerl env prepare swe` "
                                      "once, with the registry reachable)" if rec.recipe.pip_packages
                                      or rec.recipe.install else "")
            lines = [ln.strip() for ln in result.output.splitlines() if ln.strip()]
            last = lines[-1] if lines else "(no output)"
            raise SetupFailed(f"setting up the task's environment failed: `{step}` {why}{net}: {last}"
                              f"{_backend_hint(result.output)} (output: {sandbox._tail(result.output, lines=8, chars=800)})")
    return installed


def make(root: Path, checkout: Path, rec: TaskRecord, *, kind: str, checkout_at: str, network: bool = False,
         git_dir: Path | None = None, timeout_s: float = 600.0, record: bool = False) -> TestEnv:
    """Make the environment at ``root`` for ``checkout`` (seen at ``checkout_at`` in the sandbox).
    ``record``: keep what the recipe leaves in ``checkout`` (a clean checkout with its git
    directory ``git_dir``) for :meth:`TestEnv.lay_into` other checkouts."""
    t0 = time.monotonic()
    shutil.rmtree(root, ignore_errors=True)
    root.parent.mkdir(parents=True, exist_ok=True)
    make_layered_venv(root)
    for module, source in _COPIED.items():
        shutil.copyfile(source, _site_packages(root) / f"{module}.py")
    env = TestEnv(root=root, checkout_at=checkout_at)
    try:
        installed = _install(env, checkout, rec, kind=kind, network=network, git_dir=git_dir, timeout_s=timeout_s)
        written = generated.record(checkout, git_dir, root / WRITTEN) if record and git_dir else generated.Written()
    except generated.WrittenError as e:
        shutil.rmtree(root, ignore_errors=True)
        raise SetupFailed(f"setting up the task's environment failed: {e}") from None
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    seconds = time.monotonic() - t0
    (root / READY).write_text(json.dumps({"key": env_key(rec), "installed": installed, "setup_s": seconds,
                                          "checkout_at": checkout_at, "written": written.to_json()}))
    return attrs.evolve(env, setup_s=seconds, installed=installed, written=written)


def _ready(root: Path) -> TestEnv:
    info = json.loads((root / READY).read_text())
    return TestEnv(root=root, checkout_at=info["checkout_at"], installed=info["installed"],
                   written=generated.Written.from_json(info.get("written")))


def cached(cache_dir: Path, rec: TaskRecord, build_checkout, *, kind: str, network: bool = False,
           timeout_s: float = 600.0) -> TestEnv:
    """The task's environment from the cache, made first if it is not there.
    ``build_checkout()`` gives (a fresh checkout at ``base_commit``, its git directory) and
    a cleanup callable; it is only called when the environment has to be made."""
    root = env_dir(cache_dir, rec)
    ready = root / READY
    if ready.is_file():
        return _ready(root)
    with _locked(root.with_name(root.name + ".lock")):
        if ready.is_file():  # another process made it while this one waited
            return _ready(root)
        checkout, git_dir, done = build_checkout()
        try:
            return make(root, checkout, rec, kind=kind, checkout_at=TESTBED, network=network, git_dir=git_dir,
                        timeout_s=timeout_s, record=True)
        finally:
            done()
