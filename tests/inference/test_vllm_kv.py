"""The vLLM backend's KV choices, without vLLM: ``inference.kv_store`` mapped onto vLLM's KV
connectors, and the combinations vLLM 0.32 refuses at start-up refused here, up front."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli

pytest.importorskip("primerl_vllm", reason='the vllm backend plugin is not installed: pip install -e plugins/inference/vllm')


def _run(**inference):
    from primerl_vllm.config import VllmConfig

    from primerl.config import RunConfig, TrainerConfig
    from primerl.models import ModelConfig

    return RunConfig(model=ModelConfig(name="qwen3-moe"), inference=VllmConfig(device="cuda", **inference),
                     trainer=TrainerConfig(), output_dir="/tmp/primerl-kv-test")


def _refused(*args: str) -> str:
    r = run_cli("run", "--env", "reverse-text", "--model", "qwen3-moe", "--inference.backend", "vllm", *args,
                "--dry-run")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    return r.stderr


def test_kv_stores_map_to_vllm_connectors(tmp_path):
    from primerl_vllm.launch import kv_dir, vllm_command, vllm_env

    disk = _run(kv_store="disk")
    cmd = vllm_command(disk, tmp_path, 1234)
    assert json.loads(cmd[cmd.index("--kv-transfer-config") + 1])["kv_connector"] == "LMCacheConnectorV1"
    assert vllm_env(disk)["LMCACHE_LOCAL_DISK"] == f"file://{kv_dir(disk)}/"

    mooncake = _run(kv_store="mooncake")
    cmd = vllm_command(mooncake, tmp_path, 1234)
    assert json.loads(cmd[cmd.index("--kv-transfer-config") + 1])["kv_connector"] == "MooncakeStoreConnector"
    from pathlib import Path

    settings = json.loads(Path(vllm_env(mooncake)["MOONCAKE_CONFIG_PATH"]).read_text())
    assert settings["master_server_address"] and settings["protocol"] in ("tcp", "rdma")

    assert "--kv-transfer-config" not in vllm_command(_run(), tmp_path, 1234)  # memory: vLLM's prefix cache


def test_routed_experts_with_a_connector_vllm_refuses_them_with_is_refused_up_front():
    from primerl_vllm.config import VllmConfig

    from primerl.errors import ConfigError

    for connector in ("NixlConnector", "MooncakeConnector"):
        transfer = json.dumps({"kv_connector": connector, "kv_role": "kv_producer"})
        run = _run(kv_transfer_config=transfer, return_routed_experts=True)
        with pytest.raises(ConfigError, match=f"uses {connector}, with which vLLM refuses to return routed experts"):
            VllmConfig._check_kv(run.inference, run, lambda k: "", "cuda")
    multi = json.dumps({"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_connector_extra_config": {
        "connectors": [{"kv_connector": "OffloadingConnector"}, {"kv_connector": "NixlConnector"}]}})
    run = _run(kv_transfer_config=multi, return_routed_experts=True)
    with pytest.raises(ConfigError, match="NixlConnector"):
        VllmConfig._check_kv(run.inference, run, lambda k: "", "cuda")
    ok = _run(kv_transfer_config=json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}),
              return_routed_experts=True)
    VllmConfig._check_kv(ok.inference, ok, lambda k: "", "cuda")


def test_kv_stores_that_need_vllms_gpu_build_are_refused_on_cpu():
    err = _refused("--inference.device", "cpu", "--inference.kv_store", "disk")
    assert "LMCacheConnectorV1" in err and "--inference.backend embedded" in err
    err = _refused("--inference.kv_store", "mooncake", "--inference.kv_transfer_config",
                   '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}', "--inference.device", "cuda")
    assert "keep one" in err
