"""Install the project in the working directory into this interpreter's environment, editable.

``python -m primerl_swe_editable`` (this file, copied into every task environment) is the
default install of a task's checkout: the standard editable install (PEP 517 and PEP 660)
with the project's own build backend, as ``pip install --no-deps --no-build-isolation -e .``
does it, without pip's own start-up and its second backend call (pip prepares metadata in
one backend process and builds in another): about a third of pip's time. It

1. reads ``[build-system]`` from ``pyproject.toml`` (no table, or no file: setuptools'
   legacy backend, as pip does), with ``backend-path``;
2. calls the backend's ``build_editable`` (the backend and what it imports come from the
   environment: no isolation, no network);
3. installs the wheel as an installer does (PEP 427): its files into ``purelib``, its
   ``.data`` folders into their scheme paths, console and GUI scripts from
   ``entry_points.txt`` into ``bin``, ``INSTALLER`` and ``direct_url.json`` (editable) in its
   ``.dist-info``.

A backend without ``build_editable``, or a build that fails, exits non-zero with the cause.
"""

from __future__ import annotations

import configparser
import importlib
import json
import os
import sys
import sysconfig
import tempfile
import zipfile
from pathlib import Path

SCHEME = {"purelib": "purelib", "platlib": "platlib", "scripts": "scripts", "headers": "include", "data": "data"}
SCRIPT = "#!{python}\nimport sys\nfrom {module} import {attr}\nsys.exit({call}())\n"


def _backend():
    path = Path("pyproject.toml")
    table = {}
    if path.is_file():
        try:
            import tomllib
        except ImportError:  # Python 3.10
            import tomli as tomllib
        table = tomllib.loads(path.read_text()).get("build-system", {})
    name = table.get("build-backend", "setuptools.build_meta:__legacy__")
    for entry in reversed(table.get("backend-path", [])):
        sys.path.insert(0, os.path.abspath(entry))
    module, _, attrs = name.partition(":")
    backend = importlib.import_module(module)
    for attr in filter(None, attrs.split(".")):
        backend = getattr(backend, attr)
    return name, backend


def _install(wheel: Path, project: Path) -> str:
    paths = sysconfig.get_paths()
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if not n.endswith("/")]
        dist_info = next(n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")
                         and n.endswith("/METADATA"))
        data = dist_info[: -len(".dist-info")] + ".data"
        for name in names:
            parts = name.split("/")
            if parts[0] == data and len(parts) > 2:
                dest = Path(paths[SCHEME[parts[1]]], *parts[2:])
            else:
                dest = Path(paths["purelib"], *parts)
            dest.parent.mkdir(parents=True, exist_ok=True)
            content = z.read(name)
            if parts[0] == data and parts[1] == "scripts" and content.startswith(b"#!python"):
                content = b"#!" + sys.executable.encode() + content[len(b"#!python"):]
            dest.write_bytes(content)
            if parts[0] == data and parts[1] == "scripts":
                dest.chmod(0o755)
    info = Path(paths["purelib"], dist_info)
    entry_points = info / "entry_points.txt"
    if entry_points.is_file():
        parser = configparser.ConfigParser(delimiters=("=",), interpolation=None)
        parser.optionxform = str
        parser.read_string(entry_points.read_text())
        for section in ("console_scripts", "gui_scripts"):
            for script, target in (parser.items(section) if parser.has_section(section) else []):
                module, _, attr = target.split("[")[0].strip().partition(":")
                dest = Path(paths["scripts"], script)
                dest.write_text(SCRIPT.format(python=sys.executable, module=module, attr=attr.split(".")[0],
                                              call=attr.strip()))
                dest.chmod(0o755)
    (info / "INSTALLER").write_text("primerl\n")
    (info / "direct_url.json").write_text(json.dumps({"url": project.as_uri(), "dir_info": {"editable": True}}))
    return dist_info


def main() -> None:
    project = Path.cwd()
    try:
        name, backend = _backend()
    except ImportError as e:
        sys.exit(f"the build backend cannot be imported: {type(e).__name__}: {e}")
    if not hasattr(backend, "build_editable"):
        sys.exit(f"the build backend {name} has no build_editable (PEP 660): give the task an `install` recipe")
    with tempfile.TemporaryDirectory() as out:
        try:
            wheel = Path(out, backend.build_editable(out, {}))
        except Exception as e:  # noqa: BLE001 - the backend's own error: shown whole, then in one line
            import traceback

            traceback.print_exc()
            sys.exit(f"the build backend {name} failed: {type(e).__name__}: {e}")
        dist_info = _install(wheel, project)
    print(f"installed {dist_info[: -len('.dist-info')]} (editable, {name})")


if __name__ == "__main__":
    main()
