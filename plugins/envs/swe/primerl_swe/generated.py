"""What a task's install writes into the checkout, kept with its cached environment and laid
into every episode's fresh checkout.

Builds write into the source tree: hatch-vcs's build hook writes ``version-file``,
setuptools-scm ``write_to``/``version_file``, custom build hooks and ``build_py`` steps write
generated modules, in-place extension builds their binaries; ``pre_install`` commands edit
tracked files. A task's environment is made once, on a checkout of its own, so what its recipe
left in that checkout is recorded (:func:`record`): git lists the files that are not tracked
(ignored ones too: generated files usually are) and the tracked files that changed or went,
bytecode caches left out; copies are stored beside the environment. Each episode's fresh
checkout then gets them (:func:`lay`): a copy per file, no build. The tests see the checkout
exactly as the project's own editable install leaves it.

When the tests still cannot import a module, :func:`explain` says whether the missing file is
one the build generates (declared by the build configuration, ignored by git, or compiled from
a ``.pyx``/``.c`` source in the checkout), which the install did not write.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import attrs

# the build configuration keys that name a file the build writes into the tree (pyproject.toml)
DECLARED = (("tool", "hatch", "build", "hooks", "vcs", "version-file"), ("tool", "setuptools_scm", "write_to"),
            ("tool", "setuptools_scm", "version_file"), ("tool", "setuptools-scm", "write_to"),
            ("tool", "setuptools-scm", "version_file"))
_SETUP_PY = re.compile(r"""["']?(write_to|version_file)["']?\s*[:=]\s*["']([^"']+)["']""")
_COMPILED = (".pyx", ".c", ".cpp")  # an extension module's sources: the build compiles it
_SKIP = ("__pycache__",)  # bytecode: written by any import, never part of what the build leaves


class WrittenError(RuntimeError):
    """The install's output could not be recorded (git failed, a path leads outside the checkout)."""


@attrs.frozen
class Written:
    """What the recipe left in the checkout: ``files`` (added or changed, copies in the store),
    ``removed`` (tracked files it deleted) and ``missing`` (files the build configuration
    declares that it did not write, as ``"path (key)"``)."""

    files: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"files": list(self.files), "removed": list(self.removed), "missing": list(self.missing)}

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> Written:
        data = data or {}
        return cls(tuple(data.get("files", ())), tuple(data.get("removed", ())), tuple(data.get("missing", ())))


def _git(checkout: Path, git_dir: Path, args: list[str]) -> str:
    r = subprocess.run(["git", "--git-dir", str(git_dir), "--work-tree", str(checkout), "-c", "core.fsmonitor=false",
                        "-c", "core.hooksPath=/dev/null", *args], cwd=checkout, capture_output=True, text=True)
    if r.returncode not in (0, 1):
        raise WrittenError(f"git {' '.join(args)} failed in {checkout}: {r.stderr.strip()}")
    return r.stdout


def _ignored(checkout: Path, git_dir: Path, rel: str) -> bool:
    """Whether the repository's ignore rules (``.gitignore``) cover ``rel``."""
    args = ["git", "--git-dir", str(git_dir), "--work-tree", str(checkout), "check-ignore", "-q", "--no-index", rel]
    return subprocess.run(args, cwd=checkout, capture_output=True).returncode == 0


def _inside(root: Path, rel: str) -> bool:
    """Whether ``rel``'s parent directory, symlinks resolved, is inside ``root``."""
    real_root = os.path.realpath(root)
    parent = os.path.realpath(os.path.join(real_root, os.path.dirname(rel)))
    return parent == real_root or parent.startswith(real_root + os.sep)


def declared(checkout: Path) -> list[tuple[str, str]]:
    """The files the build configuration says the build writes: ``(path, where it is said)``."""
    found: list[tuple[str, str]] = []
    pyproject = checkout / "pyproject.toml"
    if pyproject.is_file():
        try:
            import tomllib
        except ImportError:  # Python 3.10
            import tomli as tomllib
        try:
            data = tomllib.loads(pyproject.read_text(errors="replace"))
        except ValueError:
            data = {}
        for keys in DECLARED:
            value: Any = data
            for k in keys:
                value = value.get(k) if isinstance(value, dict) else None
            if isinstance(value, str) and value:
                found.append((value, f"pyproject.toml [{'.'.join(keys[:-1])}] {keys[-1]}"))
    setup_py = checkout / "setup.py"
    if setup_py.is_file():
        for key, value in _SETUP_PY.findall(setup_py.read_text(errors="replace")):
            found.append((value, f"setup.py {key}"))
    return [(os.path.normpath(p), where) for p, where in dict.fromkeys(found)]


def record(checkout: Path, git_dir: Path, store: Path) -> Written:
    """Copy what the recipe added to or changed in ``checkout`` (a clean checkout before it ran)
    into ``store``; returns the record."""
    listed = _git(checkout, git_dir, ["ls-files", "-z", "--others", "--modified"]).split("\0")
    files, removed = [], []
    for rel in dict.fromkeys(p for p in listed if p):
        if set(Path(rel).parts) & set(_SKIP) or rel.endswith((".pyc", ".pyo")):
            continue
        if not _inside(checkout, rel):
            raise WrittenError(f"the install left {rel} behind a symlink leading outside the checkout")
        src = checkout / rel
        if not os.path.lexists(src):
            removed.append(rel)
        elif src.is_symlink() or src.is_file():
            dest = store / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest, follow_symlinks=False)
            files.append(rel)
    missing = [f"{path} ({where})" for path, where in declared(checkout)
               if _inside(checkout, path) and not os.path.lexists(checkout / path)]
    return Written(tuple(files), tuple(removed), tuple(missing))


def lay(written: Written, store: Path, checkout: Path) -> None:
    """Put what the recipe left (``written``, copies in ``store``) into a fresh ``checkout``."""
    for rel in written.removed:
        if _inside(checkout, rel):
            (checkout / rel).unlink(missing_ok=True)
    for rel in written.files:
        if not _inside(checkout, rel):
            raise WrittenError(f"{rel} leads outside the checkout {checkout} (through a symlink)")
        dest = checkout / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        if dest.is_symlink() or dest.is_file():
            dest.unlink()
        shutil.copy2(store / rel, dest, follow_symlinks=False)


def _module_files(checkout: Path, module: str) -> list[tuple[str, str | None]]:
    """Where ``module`` (dotted, inside a package) would live in the checkout: ``(path, the
    source it is compiled from or None)``, for each import root (the checkout, a folder in it)
    holding its package."""
    *package, name = module.split(".")
    if not package:
        return []
    roots = [checkout, *(d for d in sorted(checkout.iterdir()) if d.is_dir() and not d.name.startswith("."))]
    found = []
    for root in roots:
        pkg = root.joinpath(*package)
        if pkg.is_dir():
            rel = os.path.relpath(pkg / name, checkout)
            source = next((f"{rel}{ext}" for ext in _COMPILED if (pkg / f"{name}{ext}").is_file()), None)
            found.append((f"{rel}.py" if source is None else rel, source))
    return found


def explain(message: str, checkout: Path, git_dir: Path | None, written: Written, install: str) -> str:
    """Why a collection error ``message`` happened when the module it cannot import is a file the
    build generates that the install (``install``, the recipe's command) did not write: one
    clause to append to the error, or ``""``."""
    did_not = f"the task's install (`{install}`) did not write"
    fix = ("give the task an `install` or `pre_install` recipe that does (the default editable install runs the "
           "project's build hooks in place)")
    match = re.search(r"No module named '([\w.]+)'", message)
    decl = dict(declared(checkout))
    for rel, source in _module_files(checkout, match.group(1)) if match else []:
        if os.path.lexists(checkout / rel):
            continue
        why = decl.get(os.path.normpath(rel))
        if why is None and source is not None:
            why = f"compiled from {source}"
        if why is None and git_dir is not None and _ignored(checkout, git_dir, rel):
            why = "git ignores it"
        if why is not None:
            return f"; {rel} is a file the build writes ({why}) and {did_not} it: {fix}"
    if written.missing:
        return f"; the build declares {', '.join(written.missing)}, which {did_not}: {fix}"
    return ""
