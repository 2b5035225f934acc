"""Shared fixtures."""

import os
import subprocess
import sys
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
