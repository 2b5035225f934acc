"""A KV store from outside the repository: it declares its vLLM connector and its run service,
and the launchers and the vLLM backend use both without any change to primerl.

The store is a distribution written in ``tmp_path`` (``tests/third_party_kv.py``: its module
and its ``.dist-info`` with the ``primerl`` entry point, as pip leaves an installed plugin),
put on the ``PYTHONPATH`` of the processes that run ``primerl``: nothing in this environment
changes and no other test sees it. Nothing of primerl is mocked; the store's own parts are
small but real. A whole Slurm run with it: ``tests/launchers/test_slurm.py``.
"""

from __future__ import annotations

import importlib.util
import json
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from third_party_kv import CONNECTOR, STORE, env_with, write_store


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """A folder holding the third party's distribution as pip installs one."""
    return write_store(tmp_path_factory.mktemp("third-party"))


def primerl(site: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "primerl.cli", *args], capture_output=True, text=True,
                          env=env_with(site), timeout=180)


def processes(out: Path) -> dict[str, tuple[str, str]]:
    """``OUT/slurm/processes.txt``: each process's node and command, by name."""
    rows = [line.split("\t", 1) for line in (out / "slurm" / "processes.txt").read_text().splitlines()
            if not line.startswith("#")]
    return {name: tuple(rest[len("on "):].split(": ", 1)) for name, rest in rows}


def test_the_slurm_job_runs_the_service_the_store_declares(site, tmp_path):
    """The Slurm job places the store's run service on its first node and runs it as the
    store says (its options, from the site the job gives it, are what the servers get)."""
    out = tmp_path / "run"
    r = primerl(site, "run", "--launcher", "slurm", "--inference.kv_store", STORE, "--dry-run",
                "--output-dir", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    procs = processes(out)
    assert list(procs)[0] == "kv_service" and procs["kv_service"][0] == "node0"
    # the job's command for it, as it stands (a one-node job: inference.host, free ports)
    command = shlex.split(procs["kv_service"][1])
    options = Path(command[command.index("--options") + 1])
    service = subprocess.Popen(command, env=env_with(site), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    try:
        deadline = time.monotonic() + 60
        while not options.exists() and service.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert options.exists(), service.communicate(timeout=5)[0] if service.poll() is not None else "no options"
        assert json.loads(options.read_text()) == {"pool": "127.0.0.1:0", "launch": "<job id>"}
        assert service.poll() is None  # a run service stays until the job stops it
    finally:
        service.send_signal(signal.SIGTERM)
        said = service.communicate(timeout=30)[0]
    assert service.returncode == 143 and "third-party pool at 127.0.0.1:0" in said


# What a vLLM server of the run is started with: ``CONFIG`` builds the run config as that
# server reads it; the run-time record says what the store's run service set up.
SERVED = """
import json
from pathlib import Path

import attrs
from primerl.config import ConfigSources, load_config
from primerl.inference import InferenceConfig
from primerl.rundir import RunDir
from primerl.runtime import RunTime
from primerl_vllm.config import VllmConfig
from primerl_vllm.launch import vllm_command, vllm_env

out = Path(OUT)
{config}
RunTime(inference_urls=("http://127.0.0.1:8000",), kv_store_options={{"pool": "10.0.0.1:7000"}}).write(RunDir(out))
cmd = vllm_command(cfg, "/model", 8123)
env = vllm_env(cfg)
print(json.dumps({{"transfer": json.loads(cmd[cmd.index("--kv-transfer-config") + 1]),
                  "env": env.get("THIRD_PARTY_KV_POOL")}}))
"""


def check_served(site: Path, out: Path, config: str) -> None:
    """vLLM's ``--kv-transfer-config``, environment and files for a server of the run in
    ``out``: the store's connector, given the options its run service set."""
    script = f"OUT = {str(out)!r}\n" + SERVED.format(config=textwrap.dedent(config))
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env_with(site), timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["transfer"] == {"kv_connector": CONNECTOR, "kv_role": "kv_both",
                               "kv_connector_module_path": "primerl_kv_third.connector",
                               "kv_connector_extra_config": {"pool": "10.0.0.1:7000"}}
    assert got["env"] == "10.0.0.1:7000"
    assert (out / "kv" / "third.json").exists()  # the connector's file, written before vLLM starts


def test_the_vllm_backend_plays_the_connector_the_store_declares(site, tmp_path):
    """The vLLM backend's command line for a run with the store, its ``[inference]`` the
    backend's section built from the shared keys (loading it through the config wants vLLM
    installed: the next test)."""
    pytest.importorskip("primerl_vllm", reason='the vllm backend plugin is not installed: pip install -e '
                                               'plugins/inference/vllm')
    (tmp_path / "run").mkdir()
    check_served(site, tmp_path / "run", f"""
        cfg = load_config(ConfigSources(overrides=[("inference.kv_store", {STORE!r}), ("output_dir", str(out))]))
        shared = {{f.name: getattr(cfg.inference, f.name) for f in attrs.fields(InferenceConfig)}}
        cfg = attrs.evolve(cfg, inference=VllmConfig(**{{**shared, "backend": "vllm"}}))
    """)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                    reason='the vllm backend refuses a config without vLLM installed: pip install -e '
                           '"plugins/inference/vllm[cpu]" (CPU; [gpu] on a CUDA machine)')
def test_a_vllm_slurm_dry_run_wires_the_stores_connector_and_service(site, tmp_path):
    """``primerl run --inference.backend vllm --launcher slurm --dry-run`` with the store: the
    job starts its service first, and a server reading the config the dry run wrote starts
    vLLM with the store's connector."""
    out = tmp_path / "run"
    r = primerl(site, "run", "--model", "qwen3", "--inference.backend", "vllm", "--launcher", "slurm",
                "--inference.kv_store", STORE, "--dry-run", "--output-dir", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    assert list(processes(out))[0] == "kv_service"
    check_served(site, out, """
        cfg = load_config(ConfigSources(files=[str(out / "config.toml")]))
        assert isinstance(cfg.inference, VllmConfig)
    """)
