"""`primerl inference` as users run it: a real process, the official openai client."""

import socket
import subprocess
import sys
import time

import httpx
import pytest

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "primerl.cli", "inference", "--model", "glm5", "--host", "127.0.0.1",
         "--port", str(port), "--inference.max_model_len", "256"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stdout.read()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.3)
    yield url
    proc.terminate()
    proc.wait(timeout=30)


def test_openai_completions_with_logprobs(server):
    from openai import OpenAI

    client = OpenAI(base_url=server + "/v1", api_key="none")
    r = client.completions.create(model="glm5", prompt="hello", max_tokens=8, temperature=0.8, logprobs=2, seed=1)
    choice = r.choices[0]
    assert len(choice.logprobs.token_logprobs) == len(choice.logprobs.tokens) > 0
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)
    extra = choice.model_extra
    assert len(extra["token_ids"]) == len(choice.logprobs.tokens)
    assert extra["policy_versions"] == [0] * len(extra["token_ids"])
    assert r.usage.completion_tokens == len(extra["token_ids"])


def test_openai_chat_with_logprobs(server):
    from openai import OpenAI

    client = OpenAI(base_url=server + "/v1", api_key="none")
    r = client.chat.completions.create(model="glm5", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=6, logprobs=True, top_logprobs=2, n=2, seed=0)
    assert len(r.choices) == 2
    for c in r.choices:
        assert isinstance(c.message.content, str)
        assert len(c.logprobs.content) == len(c.model_extra["token_ids"])
        assert len(c.logprobs.content[0].top_logprobs) == 2
    assert [m.id for m in client.models.list().data] == ["glm5"]


@pytest.mark.parametrize("body, fragment", [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": "x", "max_tokens": 100000}, "exceeds the model length"),
    ({"prompt": [999999999], "max_tokens": 2}, "token ids"),
    ({"prompt": "x", "stream": True}, "stream"),
])
def test_malformed_requests_get_400_and_server_stays_up(server, body, fragment):
    r = httpx.post(server + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]["message"]
    assert httpx.get(server + "/health").status_code == 200


def test_not_json_and_oversized_bodies(server):
    r = httpx.post(server + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400
    r = httpx.post(server + "/v1/completions", content=b"x" * (9 * 1024 * 1024),
                   headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert httpx.get(server + "/health").status_code == 200


def test_metrics_and_admin(server, tmp_path):
    text = httpx.get(server + "/metrics").text
    for name in ("primerl_requests_total", "primerl_generation_tokens_total", "primerl_batch_size",
                 "primerl_kv_cache_usage", "primerl_policy_version"):
        assert name in text
    assert httpx.post(server + "/admin/pause").json()["paused"] is True
    assert httpx.post(server + "/admin/resume").json()["paused"] is False
    r = httpx.post(server + "/admin/weights", json={"path": str(tmp_path / "missing")})
    assert r.status_code == 400 and "does not exist" in r.json()["error"]["message"]
    assert httpx.get(server + "/health").json()["policy_version"] == 0


def test_weight_update_from_hf_checkpoint(server, tmp_path):
    from primerl.models import ModelConfig
    from primerl.registry import get_registry

    adapter = get_registry().load("model", "glm5")()
    cfg = ModelConfig(name="glm5", preset="tiny", seed=5)
    adapter.save_checkpoint(adapter.build(cfg), tmp_path / "step_1", tokenizer=adapter.tokenizer(cfg))
    r = httpx.post(server + "/admin/weights", json={"path": str(tmp_path / "step_1"), "version": 1}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["policy_version"] == 1
    out = httpx.post(server + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=60).json()
    assert out["choices"][0]["policy_versions"] == [1, 1, 1]


def test_weight_update_during_a_rollout_is_recorded_in_its_version_span(server, tmp_path):
    """A request in flight when new weights land finishes, and its tokens show both versions."""
    import threading

    from primerl.models import ModelConfig
    from primerl.registry import get_registry

    adapter = get_registry().load("model", "glm5")()
    cfg = ModelConfig(name="glm5", preset="tiny", seed=11)
    adapter.save_checkpoint(adapter.build(cfg), tmp_path / "step_2")
    before = httpx.get(server + "/health").json()["policy_version"]
    result = {}

    def long_rollout():
        body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 200, "ignore_eos": True,
                "temperature": 1.0, "seed": 1}
        result["r"] = httpx.post(server + "/v1/chat/completions", json=body, timeout=120).json()

    t = threading.Thread(target=long_rollout)
    t.start()
    deadline = time.time() + 60
    while httpx.get(server + "/admin/status").json()["running"] == 0:  # wait until it is decoding
        assert time.time() < deadline
        time.sleep(0.01)
    time.sleep(0.05)
    r = httpx.post(server + "/admin/weights", json={"path": str(tmp_path / "step_2"), "version": before + 1},
                   timeout=60)
    assert r.status_code == 200, r.text
    t.join()
    versions = result["r"]["choices"][0]["policy_versions"]
    assert len(versions) == 200 and result["r"]["choices"][0]["finish_reason"] == "length"
    assert versions[0] == before and versions[-1] == before + 1
    assert versions == sorted(versions)
