"""Hostile input and exposure: the API key, oversized and streamed bodies, a full queue, and
property-based requests against a real server (``primerl inference`` processes and the
embedded app in-process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest
from conftest import free_port, run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

KEY = "s3cret-test-key"


def test_binding_beyond_loopback_without_a_key_is_refused():
    env = {k: v for k, v in os.environ.items() if k != "PRIMERL_API_KEY"}
    r = run_cli("inference", "--model", "glm5", "--host", "0.0.0.0", "--port", str(free_port()), env=env)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "needs an API key: set PRIMERL_API_KEY" in r.stderr


@pytest.fixture(scope="module")
def exposed():
    """``primerl inference --host 0.0.0.0`` with PRIMERL_API_KEY set, reached on loopback."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "primerl.cli", "inference", "--model", "glm5", "--host", "0.0.0.0",
                             "--port", str(port), "--inference.max_model_len", "256"],
                            env={**os.environ, "PRIMERL_API_KEY": KEY}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    url, auth = f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {KEY}"}
    deadline = time.time() + 120
    while True:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(url + "/health", headers=auth, timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.time() < deadline, "server not ready"
        time.sleep(0.3)
    yield url, auth
    proc.terminate()
    proc.wait(timeout=30)


@pytest.mark.parametrize("method, path", [("POST", "/admin/weights"), ("POST", "/admin/pause"),
                                          ("GET", "/admin/status"), ("POST", "/v1/completions"),
                                          ("GET", "/health"), ("GET", "/metrics")])
@pytest.mark.slow
def test_every_endpoint_refuses_requests_without_the_key(exposed, method, path):
    url, _ = exposed
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.request(method, url + path, headers=headers, json={}, timeout=10)
        assert r.status_code == 401, (path, headers, r.text)
        assert r.json()["error"]["type"] == "authentication_error"


def test_with_the_key_requests_are_served(exposed):
    url, auth = exposed
    r = httpx.post(url + "/v1/completions", headers=auth, timeout=60,
                   json={"model": "glm5", "prompt": "hello", "max_tokens": 4, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["token_ids"]) == 4


def test_a_50_mb_body_gets_413_and_the_server_keeps_answering(exposed):
    url, auth = exposed
    r = httpx.post(url + "/v1/completions", headers={**auth, "content-type": "application/json"},
                   content=b"x" * (50 * 1024 * 1024), timeout=60)
    assert r.status_code == 413

    def chunks():  # no Content-Length: the size is only known by reading
        for _ in range(20):
            yield b"x" * (1024 * 1024)

    r = httpx.post(url + "/v1/completions", headers={**auth, "content-type": "application/json"}, content=chunks(),
                   timeout=60)
    assert r.status_code == 413
    assert httpx.get(url + "/health", headers=auth, timeout=10).status_code == 200


@pytest.fixture(scope="module")
def app_client():
    """The embedded app in-process on the tiny glm5 preset, with a queue of at most 4."""
    from fastapi.testclient import TestClient
    from primerl_embedded.backend import EmbeddedBackend
    from primerl_embedded.server import create_app

    from primerl.config import ConfigSources, load_config

    cfg = load_config(ConfigSources(overrides=[("model.name", "glm5"), ("inference.max_model_len", "128"),
                                               ("inference.max_queue", "4"), ("inference.max_batch_size", "4"),
                                               ("inference.kv_slots", "8")]))
    engine, tokenizer, _ = EmbeddedBackend().build(cfg)
    engine.start()
    try:
        with TestClient(create_app(engine, tokenizer, "glm5")) as client:
            yield client, engine
    finally:
        engine.stop()


def test_a_full_queue_gets_503_and_the_held_requests_finish(app_client):
    client, engine = app_client
    engine.pause()  # nothing is admitted: the queue fills
    try:
        from primerl_embedded.engine import SamplingParams

        held = engine.submit([1, 2, 3], SamplingParams(max_tokens=2, n=4))
        r = client.post("/v1/completions", json={"model": "glm5", "prompt": [1, 2, 3], "max_tokens": 2})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert "queue is full" in r.json()["error"]["message"]
    finally:
        engine.resume()
    deadline = time.time() + 60
    while not all(s.finish_reason for s in held):
        assert time.time() < deadline
        time.sleep(0.05)
    assert client.post("/v1/completions", json={"model": "glm5", "prompt": [1, 2], "max_tokens": 2}).status_code == 200


JSONISH = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=True)
                       | st.text(max_size=20),
                       lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner,
                                                                                     max_size=4), max_leaves=12)
FIELDS = st.fixed_dictionaries({}, optional={
    "model": st.text(max_size=8), "prompt": JSONISH, "messages": JSONISH, "max_tokens": JSONISH, "n": JSONISH,
    "temperature": JSONISH, "top_p": JSONISH, "logprobs": JSONISH, "echo": JSONISH, "stop": JSONISH,
    "seed": JSONISH, "top_k": JSONISH})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]), body=FIELDS)
def test_arbitrary_request_bodies_get_an_answer_never_a_crash(app_client, path, body):
    client, _ = app_client
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 8:
        body["max_tokens"] = 8  # keep generation short; absurd values are the other test's
    # NaN and infinities go out as JSON's common extension (Infinity, NaN), which parsers accept
    r = client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code in (200, 400, 503), (r.status_code, r.text)
    if r.status_code != 200:
        assert "message" in r.json()["error"]


@pytest.mark.parametrize("field, value", [("max_tokens", 10**12), ("n", 10**6), ("max_tokens", -5), ("n", 0),
                                          ("prompt", [10**9]), ("temperature", -1)])
def test_absurd_sampling_values_are_refused_with_400(app_client, field, value):
    client, _ = app_client
    body = {"model": "glm5", "prompt": [1, 2, 3], "max_tokens": 2, field: value}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"]


@pytest.mark.slow
def test_a_port_in_use_is_refused_at_once_in_one_line():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        t0 = time.time()
        r = run_cli("inference", "--model", "glm5", "--host", "127.0.0.1", "--port", str(port))
    assert r.returncode != 0 and time.time() - t0 < 30
    assert f"inference.port {port} on 127.0.0.1 cannot be used" in r.stderr and "Traceback" not in r.stderr
