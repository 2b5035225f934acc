"""Discovery from real installed distributions: pip-install plugins into a fresh environment.

A virtual environment layered over this one (it sees primerl and its built-in plugins)
gets two more distributions installed with pip: the example third-party plugin, and a
plugin whose module fails to import. Both must show in ``primerl plugins list --json``.
"""

import json
import subprocess

import pytest

pytestmark = pytest.mark.slow


def cli(py, *args):
    return subprocess.run([str(py), "-m", "primerl.cli", *args], capture_output=True, text=True, timeout=120)


def test_third_party_plugin_is_listed_ok(venv):
    r = cli(venv, "plugins", "list", "--json")
    assert r.returncode == 0, r.stderr
    rows = {(row["kind"], row["name"]): row for row in json.loads(r.stdout)}
    echo = rows[("env", "echo-digits")]
    assert echo["status"] == "ok" and echo["error"] is None
    assert echo["distribution"] == "primerl-echo" and echo["version"] == "0.1.0"
    assert echo["plugin"] == "echo"


def test_plugin_that_fails_to_import_is_listed_with_its_error(venv):
    r = cli(venv, "plugins", "list", "--json")
    assert r.returncode == 0, r.stderr
    broken = [row for row in json.loads(r.stdout) if row["distribution"] == "primerl-broken"]
    assert len(broken) == 1
    row = broken[0]
    assert row["status"] == "error" and row["kind"] == "env"  # kind read from the source, unimported
    assert "a_dependency_that_is_not_installed" in row["error"]
    assert cli(venv, "plugins", "list").returncode == 0


def test_a_run_selecting_the_third_party_env_resolves_its_config(venv):
    r = cli(venv, "run", "--env", "echo-digits", "--dry-run")
    if "no model named" in r.stderr:
        pytest.skip("glm5 plugin not installed")
    assert r.returncode == 0, r.stderr
    assert 'name = "echo-digits"' in r.stdout


def test_selecting_the_broken_plugin_fails_clearly(venv):
    r = cli(venv, "run", "--env", "broken-env", "--dry-run")
    assert r.returncode == 2
    assert "a_dependency_that_is_not_installed" in r.stderr or "no env named 'broken-env'" in r.stderr
    assert "Traceback" not in r.stderr


def test_deny_list_hides_a_plugin(venv):
    import os

    r = subprocess.run([str(venv), "-m", "primerl.cli", "plugins", "list", "--json"], capture_output=True,
                       text=True, env={**os.environ, "PRIMERL_DISABLE_PLUGINS": "primerl-broken"})
    assert all(row["distribution"] != "primerl-broken" for row in json.loads(r.stdout))
