"""Inference replicas: a server killed with requests in flight costs the run nothing.

Two real ``primerl inference`` servers behind the orchestrator's InferenceClient and the
round-robin router. One is SIGKILLed while it decodes: every request still completes
exactly once (its lost ones re-sent to the survivor and counted), the dead server is
ejected, a weight update goes on without it, and once it is restarted on its port it is
readmitted serving the current weights. With every server dead a request stops the run
with one line naming each server's cause.
"""

import asyncio
import signal
import subprocess
import sys
import time

import httpx
import pytest
from conftest import free_port
from primerl_round_robin.router import RoundRobinRouter

from primerl.orchestrator.client import InferenceClient, NoServerUp
from primerl.registry import get_registry

SERVER_ARGS = ("--model", "glm5", "--inference.max_model_len", "256")


def start_server(port: int) -> subprocess.Popen:
    """``primerl inference`` on ``port`` (fixed, so it can be restarted there), once it answers."""
    proc = subprocess.Popen([sys.executable, "-m", "primerl.cli", "inference", *SERVER_ARGS,
                             "--host", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stdout.read()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        assert time.time() < deadline, "server not ready after 120s"
        time.sleep(0.2)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


def save_weights(path, seed: int):
    from primerl.models import ModelConfig

    adapter = get_registry().load("model", "glm5")()
    cfg = ModelConfig(name="glm5", preset="tiny", seed=seed)
    adapter.save_checkpoint(adapter.build(cfg), path, tokenizer=adapter.tokenizer(cfg))
    return path


class CountingRouter(RoundRobinRouter):
    """The real round-robin router, also counting how every request ended on every server."""

    def __init__(self) -> None:
        super().__init__()
        self.ended: dict[tuple[str, bool], int] = {}
        self.told: list[list[str]] = []

    def finished(self, request, url, *, ok, seconds):
        self.ended[url, ok] = self.ended.get((url, ok), 0) + 1
        super().finished(request, url, ok=ok, seconds=seconds)

    def servers_up(self, servers):
        self.told.append(list(servers))
        super().servers_up(servers)


async def wait_for(predicate, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


@pytest.mark.slow
def test_a_killed_server_is_survived_ejected_and_readmitted_with_the_current_weights(tmp_path):
    ports = [free_port(), free_port()]
    while ports[1] == ports[0]:
        ports[1] = free_port()
    procs = [start_server(p) for p in ports]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    v1, v2 = save_weights(tmp_path / "step_1", 5), save_weights(tmp_path / "step_2", 6)
    router = CountingRouter()
    client = InferenceClient(urls, router, probe_every_s=0.2, all_down_s=3.0)
    requests = 8
    body = {"model": "glm5", "messages": [{"role": "user", "content": "go"}], "n": 2, "max_tokens": 200,
            "ignore_eos": True, "temperature": 1.0, "logprobs": True}

    async def go():
        try:
            await client.wait_ready()
            await client.load_weights(v1, 1)
            assert [httpx.get(u + "/health").json()["policy_version"] for u in urls] == [1, 1]
            jobs = [asyncio.create_task(client.chat(dict(body), session=f"group-{i}")) for i in range(requests)]
            # kill the second server while it is decoding its share
            await wait_for(lambda: httpx.get(urls[1] + "/admin/status").json()["running"] > 0, 60, "decoding")
            await asyncio.sleep(0.2)
            procs[1].send_signal(signal.SIGKILL)
            procs[1].wait()
            answers = await asyncio.wait_for(asyncio.gather(*jobs), 300)

            # every request completed once, whole
            assert len(answers) == requests
            for a in answers:
                assert len(a["choices"]) == 2
                assert all(len(c["token_ids"]) == 200 and c["policy_versions"] == [1] * 200 for c in a["choices"])
            lost = router.ended.get((urls[1], False), 0)
            assert lost >= 1  # the killed server had requests in flight
            assert router.ended.get((urls[0], True), 0) + router.ended.get((urls[1], True), 0) == requests
            # ejected: out of routing, the router told, counted
            assert client.servers_up() == [urls[0]] and [urls[0]] in router.told
            assert client.take_metrics() == {"inference/resent": lost, "inference/servers_up": 1}
            assert client.take_metrics()["inference/resent"] == 0  # per batch: counted once

            # a weight update skips the dead server and does not wait for it
            t0 = time.monotonic()
            await asyncio.wait_for(client.load_weights(v2, 2), 60)
            assert time.monotonic() - t0 < 30
            assert httpx.get(urls[0] + "/health").json()["policy_version"] == 2
            more = await asyncio.gather(*(client.chat(dict(body, max_tokens=4, n=1)) for _ in range(4)))
            assert all(a["choices"][0]["policy_versions"] == [2] * 4 for a in more)

            # restarted on its port: readmitted only after it was given v2
            procs[1] = await asyncio.to_thread(start_server, ports[1])
            await wait_for(lambda: client.state[urls[1]].up, 60, "readmission")
            assert httpx.get(urls[1] + "/health").json()["policy_version"] == 2
            assert client.servers_up() == urls and router.told[-1] == urls
            before = router.ended.get((urls[1], True), 0)
            again = await asyncio.gather(*(client.chat(dict(body, max_tokens=4, n=1)) for _ in range(4)))
            assert router.ended.get((urls[1], True), 0) > before  # it serves again
            assert all(a["choices"][0]["policy_versions"] == [2] * 4 for a in again)
            assert client.take_metrics() == {"inference/resent": 0, "inference/servers_up": 2}

            # every server dead: a request stops with each server's cause, in one line
            for p in procs:
                p.send_signal(signal.SIGKILL)
                p.wait()
            with pytest.raises(NoServerUp) as failed:
                await asyncio.wait_for(client.chat(dict(body, max_tokens=4, n=1)), 60)
            message = str(failed.value)
            assert "\n" not in message and "no inference server has answered for 3s" in message
            assert all(u in message for u in urls)
        finally:
            await client.close()

    try:
        asyncio.run(go())
    finally:
        for p in procs:
            stop(p)


def test_round_robin_skips_ejected_servers_and_moves_their_sessions():
    from primerl.routers import Route

    router = RoundRobinRouter()
    router.start(["http://a", "http://b", "http://c"])
    first = router.route(Route(path="/v1/completions", session="s"))
    router.servers_up([u for u in router.servers if u != first])
    moved = router.route(Route(path="/v1/completions", session="s"))
    assert moved != first
    assert first not in {router.route(Route(path="/v1/completions")) for _ in range(6)}
    assert router.route(Route(path="/v1/completions", session="s")) == moved  # and stays there
    router.servers_up(router.servers)  # readmitted: back in the turn
    assert first in {router.route(Route(path="/v1/completions")) for _ in range(3)}


class FirstServerRouter:
    """A router that ignores health (its ``servers_up`` does nothing): always the first server."""

    def start(self, servers):
        self.servers = list(servers)

    def route(self, request):
        return self.servers[0]

    def finished(self, request, url, *, ok, seconds):
        pass

    def servers_up(self, servers):
        pass

    def headers(self, request):
        return {}

    def close(self):
        pass


def test_a_router_unaware_of_health_never_gets_a_request_to_an_ejected_server():
    client = InferenceClient(["http://a", "http://b"], FirstServerRouter())

    async def go():
        client.router.start(client.servers)
        for srv in client.state.values():
            srv.admit()
        assert client.base_url("s") == "http://a"
        client.eject("http://a", "ConnectError: refused")
        assert client.servers_up() == ["http://b"]
        assert client.base_url("s") == "http://b"
        assert client.take_metrics() == {"inference/resent": 0, "inference/servers_up": 1}
        await client.close()

    asyncio.run(go())
