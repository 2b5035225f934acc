"""The ``mooncake`` KV store against a real Mooncake master (TCP): one pool shared by every
engine, so a prefix computed on one server is restored on another, with the routed experts
of its tokens (router replay stays exact); the master helper; the errors that name a fix.

Skipped, with the reason, only where Mooncake cannot be installed or loaded here."""

import base64
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest
import torch

from primerl.kv_stores import KVStore
from primerl.registry import get_registry

install = pytest.importorskip("primerl_kv_mooncake.install", reason="the mooncake KV store plugin is not installed: "
                              "pip install -e plugins/kv_stores/mooncake")
try:
    install.import_store()
    install.master_binary()
except install.MooncakeUnavailable as exc:
    pytest.skip(str(exc), allow_module_level=True)

from conftest import greedy
from primerl_embedded.engine import Engine
from primerl_kv_mooncake.master import MooncakeMaster, start_master
from primerl_kv_mooncake.store import MooncakeStore

pytestmark = pytest.mark.slow  # every test starts a Mooncake master

SMALL = dict(segment_bytes=64 << 20, buffer_bytes=16 << 20)  # what each test client lends the pool


@pytest.fixture(scope="module")
def master():
    with start_master() as m:
        yield m


def engine(glm5, store):
    model, tok = glm5
    return Engine(model, kv_store=store, eos_token_ids=[tok.eos_token_id], max_batch_size=2, max_model_len=512,
                  kv_slots=4, num_experts=8)


def test_master_helper_serves_and_its_options_reach_it(master):
    assert master.ready() and master.options() == {"master": master.address, "metadata": master.metadata_url}
    # the master's HTTP metadata server (without it: P2P handshake), as the backend builds the store
    store = get_registry().load("kv_store", "mooncake")(**master.options(), block_size=32, **SMALL)
    try:
        assert isinstance(store, MooncakeStore) and store.pool_blocks.block_size == 32
        for name in ("bind", "lookup", "load", "vacate", "keep", "clear", "slots", "handoff_blocks"):
            assert callable(getattr(store, name)) and name in vars(KVStore)
    finally:
        store.close()


def test_a_prefix_computed_on_one_engine_is_restored_on_another(master, glm5):
    _, tok = glm5
    a = MooncakeStore(master.address, block_size=16, **SMALL)
    b = MooncakeStore(master.address, block_size=16, **SMALL)
    try:
        ea, eb = engine(glm5, a), engine(glm5, b)
        prompt = tok.encode("Reverse: one system prompt that every server of the run sees. " * 3)
        (cold,) = ea.generate(prompt, greedy())
        assert a.stats.saved_blocks == (len(cold.tokens) - 1) // 16  # written when it finished
        (warm,) = eb.generate(prompt, greedy())
        assert b.stats.restored_tokens == eb.stats.prefix_hit_tokens == (len(prompt) // 16) * 16 > 0
        assert b.stats.saved_blocks == 0  # every full block was already in the pool
        # router replay: same tokens, and the experts of every token, restored ones included
        assert warm.output_ids == cold.output_ids
        assert torch.equal(warm.routed_experts(), cold.routed_experts())
        # a new policy version: both servers miss what the old one computed
        ea.update_weights(lambda: None, version=1)
        eb.update_weights(lambda: None, version=1)
        assert a.lookup(prompt) is None and b.lookup(prompt) is None
        (v1,) = ea.generate(prompt, greedy())
        assert b.lookup(prompt).length == (len(prompt) // 16) * 16 and v1.versions == [1] * 8
    finally:
        a.close()
        b.close()


def test_the_master_command_prints_its_options_then_serves_until_stopped():
    proc = subprocess.Popen([sys.executable, "-m", "primerl_kv_mooncake.master"], stdout=subprocess.PIPE, text=True)
    try:
        lines = [proc.stdout.readline().strip() for _ in range(2)]
        options = dict(line.split("=", 1) for line in lines)
        assert list(options) == ["master", "metadata"]  # the metadata line last: "serving"
        store = MooncakeStore(**options, **SMALL)
        store.close()
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0


def test_errors_name_the_fix():
    with pytest.raises(install.MooncakeUnavailable, match="inference.kv_store_options.master"):
        MooncakeStore()
    t = time.monotonic()
    with pytest.raises(install.MooncakeUnavailable, match="cannot reach the Mooncake master at 127.0.0.1:9"):
        MooncakeStore("127.0.0.1:9", "http://127.0.0.1:9/metadata", **SMALL)
    assert time.monotonic() - t < 10  # not Mooncake's own 90 s of retries
    fix = install.missing_library_fix("libibverbs.so.1: cannot open shared object file: No such file or directory")
    assert fix.startswith("apt-get install libibverbs1")
    assert install.missing_library_fix("No module named 'mooncake'") is None


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def test_the_master_dies_with_the_process_that_started_it():
    parent = subprocess.Popen(
        [sys.executable, "-c", "import time; from primerl_kv_mooncake.master import start_master; "
                               "m = start_master(); print(m.proc.pid, flush=True); time.sleep(120)"],
        stdout=subprocess.PIPE, text=True)
    pid = int(parent.stdout.readline())
    assert _state(pid) not in (None, "Z")
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 15
    while _state(pid) not in (None, "Z") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _state(pid) in (None, "Z")


def test_master_that_cannot_start_says_why(tmp_path):
    busy = MooncakeMaster()
    with busy:
        clash = MooncakeMaster(rpc_port=busy.rpc_port, log=tmp_path / "m.log")
        with pytest.raises(install.MooncakeUnavailable, match="mooncake_master"):
            clash.start(timeout=20)
        clash.stop()


def _completion(url: str, prompt: list[int]) -> dict:
    r = httpx.post(url + "/v1/completions", json={
        "model": "glm5", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
        "return_routed_experts": True}, timeout=120)
    r.raise_for_status()
    choice = r.json()["choices"][0]
    routed = choice["routed_experts"]
    experts = torch.frombuffer(bytearray(base64.b64decode(routed["data"])), dtype=getattr(torch, routed["dtype"]))
    return {"tokens": choice["token_ids"], "experts": experts.view(routed["shape"])}


def _hit_tokens(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return float(re.search(r"^primerl_prefix_cache_hit_tokens_total (\S+)$", text, re.M).group(1))


@pytest.mark.slow
def test_two_inference_servers_share_one_pool(master):
    """Two `primerl inference` processes with --inference.kv_store mooncake: a prompt served by
    the first is restored by the second from the pool, with the same tokens and experts."""
    from conftest import InferenceServer

    options = {**master.options(), "block_size": 16, "segment_bytes": 64 << 20, "buffer_bytes": 16 << 20}
    args = ("--model", "glm5", "--inference.kv_store", "mooncake", "--inference.max_model_len", "512",
            "--inference.kv_slots", "64", *[a for k, v in options.items()
                                            for a in (f"--inference.kv_store_options.{k}", str(v))])
    prompt = list(range(5, 250)) + list(range(5, 100))
    with InferenceServer(*args) as one, InferenceServer(*args) as two:
        first = _completion(one.url, prompt)
        assert _hit_tokens(two.url) == 0
        second = _completion(two.url, prompt)
        assert _hit_tokens(two.url) == (len(prompt) // 16) * 16
    assert second["tokens"] == first["tokens"]
    assert torch.equal(second["experts"], first["experts"]) and len(first["experts"]) == len(prompt) + 7
