"""Shared fixtures."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_cli(*args: str, env: dict | None = None, timeout: float = 120, cwd: Path | None = None):
    """Run ``primerl`` in a fresh interpreter, as a user would."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "primerl.cli", *args],
        capture_output=True, text=True, env=full_env, timeout=timeout, cwd=cwd,
    )


@pytest.fixture
def cli():
    return run_cli


def _make_broken_plugin(root):
    (root / "primerl_broken").mkdir(parents=True)
    (root / "primerl_broken" / "__init__.py").write_text("")
    (root / "primerl_broken" / "plugin.py").write_text(textwrap.dedent("""
        import a_dependency_that_is_not_installed  # fails at import

        from primerl import hookimpl

        @hookimpl
        def register_envs(register):
            register("broken-env", "primerl_broken.env:Env")
    """))
    (root / "pyproject.toml").write_text(textwrap.dedent("""
        [build-system]
        requires = ["setuptools>=68"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "primerl-broken"
        version = "0.0.1"
        [project.entry-points.primerl]
        broken = "primerl_broken.plugin"
        [tool.setuptools]
        packages = ["primerl_broken"]
    """))


@pytest.fixture(scope="session")
def venv(tmp_path_factory):
    """A venv seeing the system packages, plus the example plugin and a broken one, pip-installed."""
    root = tmp_path_factory.mktemp("plugins")
    env_dir = root / "venv"
    # no pip of its own: the outer pip installs into it (--python), with the outer setuptools
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(env_dir)],
                   check=True)
    py = env_dir / "bin" / "python"
    broken = root / "broken"
    _make_broken_plugin(broken)
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", "--no-build-isolation",
         str(REPO / "examples" / "plugin-template"), str(broken)],
        check=True, capture_output=True, text=True,
    )
    return py


