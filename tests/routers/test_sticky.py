"""The ``sticky`` router over real ``primerl inference`` servers: sessions stay, new
sessions balance by in-flight counts and by the load each server's ``/metrics`` reports,
and a failed, unhealthy or ejected server is avoided and its sessions move."""

import threading
import time

import httpx
import pytest
from conftest import InferenceServer, free_port
from primerl_sticky.router import StickyRouter, parse_metrics

from primerl.registry import get_registry
from primerl.routers import Route, Router

pytestmark = pytest.mark.slow

COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def servers():
    with InferenceServer("--model", "glm5", "--inference.max_model_len", "512") as a, \
         InferenceServer("--model", "glm5", "--inference.max_model_len", "512") as b:
        yield [a.url, b.url]


@pytest.fixture
def router(servers):
    r = StickyRouter(poll_s=0.1)
    r.start(servers)
    yield r
    r.close()


def send(router, session, prompt, max_tokens=2):
    """One completion through ``router``, as the orchestrator's client sends it."""
    route = Route(path=COMPLETIONS, session=session, prompt_tokens=len(prompt))
    url = router.route(route)
    t0, ok = time.monotonic(), False
    try:
        r = httpx.post(url + COMPLETIONS, json={"model": "glm5", "prompt": prompt, "max_tokens": max_tokens},
                       timeout=60)
        ok = r.status_code == 200
    finally:
        router.finished(route, url, ok=ok, seconds=time.monotonic() - t0)
    assert ok, r.text
    return url, r.json()


def test_registered_and_fits_the_protocol():
    cls = get_registry().load("router", "sticky")
    assert cls is StickyRouter
    assert isinstance(cls(), Router)


def test_parse_metrics_sums_labels_and_skips_comments():
    text = ("# HELP primerl_batch_size x\n# TYPE primerl_batch_size gauge\nprimerl_batch_size 3\n"
            'vllm:num_requests_running{model_name="a"} 2\nvllm:num_requests_running{model_name="b"} 1.0\n'
            "vllm:kv_cache_usage_perc 0.25\nbroken line\nnan_metric NaN\n")
    assert parse_metrics(text) == {"primerl_batch_size": 3.0, "vllm:num_requests_running": 3.0,
                                   "vllm:kv_cache_usage_perc": 0.25}


def test_a_session_stays_on_its_server_and_hits_its_prefix(router, servers):
    prompt = list(range(10, 74))
    first, out = send(router, "episode-1", prompt)
    hits_before = parse_metrics(httpx.get(first + "/metrics").text)["primerl_prefix_cache_hit_tokens_total"]
    for turn in range(3):  # each turn resends the growing conversation
        prompt = prompt + out["choices"][0]["token_ids"] + [20 + turn] * 8
        url, out = send(router, "episode-1", prompt)
        assert url == first
    hits = parse_metrics(httpx.get(first + "/metrics").text)["primerl_prefix_cache_hit_tokens_total"]
    assert hits - hits_before >= 3 * 64  # every turn found at least the first prompt cached


def test_new_sessions_balance_by_in_flight_requests(router, servers):
    placed = [router.route(Route(path=COMPLETIONS, session=f"burst-{i}")) for i in range(8)]  # none finished yet
    assert {u: placed.count(u) for u in servers} == {servers[0]: 4, servers[1]: 4}
    for i, url in enumerate(placed):
        router.finished(Route(path=COMPLETIONS, session=f"burst-{i}"), url, ok=True, seconds=0.1)
    assert all(s["in_flight"] == 0 for s in router.snapshot().values())


def test_new_sessions_avoid_the_server_metrics_show_busy(router, servers):
    """Load the router never saw (requests sent to one server directly) is read from /metrics."""
    busy, idle = servers
    stop = threading.Event()

    def hammer():
        with httpx.Client(timeout=120) as http:
            while not stop.is_set():
                http.post(busy + COMPLETIONS, json={"model": "glm5", "prompt": [5] * 32, "max_tokens": 200, "n": 4,
                                                    "ignore_eos": True})

    threads = [threading.Thread(target=hammer) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 30
        while router.snapshot()[busy]["running"] + router.snapshot()[busy]["waiting"] < 2:
            assert time.monotonic() < deadline, f"/metrics never showed the load: {router.snapshot()}"
            time.sleep(0.05)
        placed = [router.route(Route(path="/v1", session=f"quiet-{i}")) for i in range(2)]  # handouts: no in-flight
        assert placed == [idle, idle]
    finally:
        stop.set()
        for t in threads:
            t.join()


def test_a_failed_server_is_avoided_and_its_sessions_move(servers):
    router = StickyRouter(poll_s=0.1, avoid_s=60)
    router.start(servers)
    try:
        sessions = {f"s{i}": router.route(Route(path="/v1", session=f"s{i}")) for i in range(6)}
        bad = sessions["s0"]
        good = next(u for u in servers if u != bad)
        router.finished(Route(path=COMPLETIONS, session="s0"), bad, ok=False, seconds=1.0)
        assert not router.snapshot()[bad]["usable"]
        for name in sessions:  # the failed server's sessions move, the others stay
            assert router.route(Route(path="/v1", session=name)) == good
        assert [router.route(Route(path="/v1", session=f"new-{i}")) for i in range(3)] == [good] * 3
        send(router, "s0", [7] * 16)  # real requests keep flowing to the good server
    finally:
        router.close()


def test_a_dead_server_is_unhealthy_and_avoided(servers):
    """A server whose process ends: /metrics stops answering, its sessions move; it is
    used again once it answers (here: a new server on the same port)."""
    dead_port = free_port()
    dead = f"http://127.0.0.1:{dead_port}"
    with InferenceServer("--model", "glm5", "--inference.max_model_len", "256") as third:
        router = StickyRouter(poll_s=0.1)
        router.start([servers[0], third.url])
        try:
            on_third = next(f"t{i}" for i in range(10)
                            if router.route(Route(path="/v1", session=f"t{i}")) == third.url)
            third.proc.kill()
            third.proc.wait()
            deadline = time.monotonic() + 10
            while router.snapshot()[third.url]["healthy"]:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert router.route(Route(path="/v1", session=on_third)) == servers[0]
            url, _ = send(router, "after-death", [9] * 16)
            assert url == servers[0]
        finally:
            router.close()
    # a server that never answered starts unhealthy: nothing is sent there
    router = StickyRouter(poll_s=0.1)
    router.start([dead, servers[1]])
    try:
        assert {router.route(Route(path="/v1", session=f"d{i}")) for i in range(4)} == {servers[1]}
    finally:
        router.close()


def test_servers_up_from_the_orchestrator_moves_sessions(router, servers):
    a, b = servers
    on_a = next(f"u{i}" for i in range(10) if router.route(Route(path="/v1", session=f"u{i}")) == a)
    router.servers_up([b])  # the client ejected a
    assert router.route(Route(path="/v1", session=on_a)) == b
    assert {router.route(Route(path="/v1", session=f"v{i}")) for i in range(4)} == {b}
    router.servers_up([a, b])  # readmitted
    assert a in {router.route(Route(path="/v1", session=f"w{i}")) for i in range(4)}


def test_close_stops_polling(servers):
    router = StickyRouter(poll_s=0.05)
    router.start(servers)
    thread = router._poller
    router.close()
    assert thread is not None and not thread.is_alive()
    with pytest.raises(ValueError, match="at least one"):
        StickyRouter().start([])


def test_through_the_orchestrators_client(servers):
    """The orchestrator's InferenceClient drives the router: an episode's turns stay on one
    server, and the client's health view reaches it (``servers_up``)."""
    import asyncio

    from primerl.orchestrator.client import InferenceClient

    def served():
        return [parse_metrics(httpx.get(u + "/metrics").text)["primerl_requests_total"] for u in servers]

    async def go():
        client = InferenceClient(servers, StickyRouter(poll_s=0.1))
        await client.wait_ready(60)
        try:
            before = served()
            ids = [40] * 24
            for _ in range(3):
                out = await client.completions({"model": "glm5", "prompt": ids, "max_tokens": 2}, session="ep-9")
                ids = ids + out["choices"][0]["token_ids"] + [41] * 4
            return [b - a for a, b in zip(before, served())]
        finally:
            await client.close()

    assert sorted(asyncio.run(go())) == [0, 3]
