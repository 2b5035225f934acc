"""The ``vllm-router`` router: the real vllm-router binary in front of real ``primerl
inference`` servers. Completions and chat completions pass through with primerl's fields,
``X-Session-ID`` keeps a session on one server under ``consistent_hash``, ejected servers
leave its worker list, and the process (with its group) is gone after ``close`` or when
the process that started it dies."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import httpx
import pytest
from conftest import InferenceServer
from primerl_vllm_router import router as vr
from primerl_vllm_router.router import VllmRouter, find_binary

from primerl.errors import PluginError
from primerl.registry import get_registry
from primerl.routers import Route, Router

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(find_binary() is None, reason=f"the vllm-router binary is not installed ({vr.INSTALL})"),
]


@pytest.fixture(scope="module")
def servers():
    with InferenceServer("--model", "glm5", "--inference.max_model_len", "256") as a, \
         InferenceServer("--model", "glm5", "--inference.max_model_len", "256") as b:
        yield [a.url, b.url]


def requests_served(url):
    text = httpx.get(url + "/metrics").text
    return int(float(next(line.split()[1] for line in text.splitlines() if line.startswith("primerl_requests_total "))))


def gone(pid, within_s=15.0):
    """Whether process group ``pid`` (the router's own) has no process left within ``within_s``."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def test_registered_and_fits_the_protocol():
    cls = get_registry().load("router", "vllm-router")
    assert cls is VllmRouter
    assert isinstance(cls(), Router)


def test_passes_primerl_responses_through_and_stops_with_no_orphan(servers):
    router = VllmRouter()  # cache_aware
    t0 = time.monotonic()
    router.start(servers)
    assert time.monotonic() - t0 < 30
    url = router.route(Route(path="/v1/completions", session="g-1"))
    assert url == router.url and url not in servers
    r = httpx.post(url + "/v1/completions", timeout=60,
                   json={"model": "glm5", "prompt": [11, 12, 13, 14], "max_tokens": 4, "logprobs": 0,
                         "ignore_eos": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert len(choice["token_ids"]) == 4 and choice["policy_versions"] == [0, 0, 0, 0]
    assert len(choice["logprobs"]["token_logprobs"]) == 4
    r = httpx.post(url + "/v1/chat/completions", timeout=60,
                   json={"model": "glm5", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "n": 2,
                         "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["prompt_token_ids"] and len(body["choices"]) == 2
    assert all(len(c["token_ids"]) == 3 and c["policy_versions"] == [0, 0, 0] for c in body["choices"])
    pid = router.pid
    router.close()
    assert gone(pid), "vllm-router still running after close()"
    router.close()  # twice is harmless


def test_consistent_hash_keeps_a_session_on_one_server_by_its_header(servers):
    router = VllmRouter(policy="consistent_hash")
    router.start(servers)
    try:
        places = set()
        for s in range(24):  # the ring hashes the run's free ports: 6 sessions all land on one ~3% of runs
            route = Route(path="/v1/completions", session=f"episode-{s}")
            assert router.headers(route) == {"X-Session-ID": f"episode-{s}"}
            seen = set()
            for turn in range(3):
                before = [requests_served(u) for u in servers]
                r = httpx.post(router.route(route) + "/v1/completions", headers=dict(router.headers(route)),
                               json={"model": "glm5", "prompt": [5 + s, 6, 7 + turn], "max_tokens": 1}, timeout=60)
                assert r.status_code == 200, r.text
                after = [requests_served(u) for u in servers]
                seen |= {u for u, x, y in zip(servers, before, after) if y > x}
            assert len(seen) == 1, f"session {s} was served by {seen}"
            places |= seen
        assert places == set(servers)  # 24 sessions hash onto both (all on one: ~1e-7)
        assert router.headers(Route(path="/v1/completions")) == {}
    finally:
        router.close()


def test_servers_up_removes_and_readds_workers(servers):
    router = VllmRouter(policy="round_robin")
    router.start(servers)
    try:
        router.servers_up([servers[0]])  # the client ejected the second
        assert httpx.get(router.url + "/list_workers").json()["urls"] == [servers[0]]
        before = requests_served(servers[1])
        for i in range(4):
            assert httpx.post(router.url + "/v1/completions", timeout=60,
                              json={"model": "glm5", "prompt": [3, 4, i], "max_tokens": 1}).status_code == 200
        assert requests_served(servers[1]) == before
        router.servers_up(servers)  # readmitted
        assert sorted(httpx.get(router.url + "/list_workers").json()["urls"]) == sorted(servers)
    finally:
        router.close()


def test_dies_with_the_process_that_started_it(servers, tmp_path):
    script = textwrap.dedent(f"""
        import time
        from primerl_vllm_router.router import VllmRouter
        r = VllmRouter()
        r.start({servers!r})
        print(r.pid, flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(parent.stdout.readline())
        os.killpg(pid, 0)  # running
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        assert gone(pid), "vllm-router outlived the process that started it"
    finally:
        if parent.poll() is None:
            parent.kill()


def test_exit_before_ready_reports_its_output(servers):
    router = VllmRouter(args="--cache-threshold not-a-number")
    with pytest.raises(RuntimeError, match=r"(?s)exited with code 2 before it was ready.*cache-threshold"):
        router.start(servers)
    assert router.proc is None


def test_missing_binary_and_unknown_policy_are_one_line_errors(monkeypatch, servers):
    monkeypatch.setattr(vr, "find_binary", lambda: None)
    with pytest.raises(PluginError, match=r"^the vllm-router router needs the vllm-router binary, which is not "
                                          r"installed: pip install vllm-router==0\.1\.17$"):
        VllmRouter().start(servers)
    with pytest.raises(PluginError, match="no policy 'nearest'; policies are cache_aware"):
        VllmRouter(policy="nearest")


def test_settings_are_router_options_and_the_environment_is_not_read(monkeypatch):
    monkeypatch.setenv("PRIMERL_VLLM_ROUTER_POLICY", "consistent_hash")  # a second channel: ignored
    r = VllmRouter(policy="consistent_hash", args="--balance-abs-threshold 8 --log-level 'info'")
    assert r.policy == "consistent_hash" and r.args == ["--balance-abs-threshold", "8", "--log-level", "info"]
    r = VllmRouter()
    assert r.policy == "cache_aware" and r.args == []


def test_through_the_orchestrators_client(servers):
    """The orchestrator's InferenceClient sends to the router's URL; the router balances."""
    import asyncio

    from primerl.orchestrator.client import InferenceClient

    async def go():
        client = InferenceClient(servers, VllmRouter(policy="round_robin"))
        await client.wait_ready(60)
        try:
            before = [requests_served(u) for u in servers]
            for i in range(4):
                out = await client.completions({"model": "glm5", "prompt": [8, 9, i], "max_tokens": 2,
                                                "ignore_eos": True},
                                               session=f"s{i}")
                assert out["choices"][0]["policy_versions"] == [0, 0]
            return [requests_served(u) - b for u, b in zip(servers, before)]
        finally:
            await client.close()

    assert asyncio.run(go()) == [2, 2]
