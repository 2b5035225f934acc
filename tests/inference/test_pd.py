"""Prefill/decode disaggregation with real servers: the same answers as one whole server.

One ``primerl inference`` prefill server and one decode server share a KV store (the disk
store in one shared directory; Mooncake Store's pool when it runs here), and a plain server
(memory store) serves the same checkpoint. The orchestrator's ``PDInferenceClient`` sends
every request to the prefill server, then to the decode server, which loads the prompt's KV
blocks instead of running them. Greedy samples must equal the plain server's token for
token, with the same log-probabilities and the same routed experts for every token (the
prompt's come from the blocks: router replay stays exact). Then the paths where the KV is
not there: a decode server at another policy version misses it, the client prefills again
and finally runs the request whole; a killed prefill server costs a prefill on the other,
a killed decode server the decode phase on the other, from the same KV.
"""

import asyncio
import base64
import contextlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import InferenceServer
from primerl_round_robin.router import RoundRobinRouter

from primerl.models import ModelConfig
from primerl.orchestrator.client import PDInferenceClient
from primerl.registry import get_registry

pytestmark = pytest.mark.slow

BLOCK = 16  # kv_store_options.block_size: prompts of 40 to 120 tokens span several blocks and a tail
PROMPTS = [list(range(5, 101)), list(range(120, 221)), list(range(7, 47))]  # 96 (block-aligned), 101, 40 tokens
GROUP = list(range(230, 319))  # 89 tokens, sampled twice (n = 2)
MAX_TOKENS = 12


def save_checkpoint(path, seed: int):
    adapter = get_registry().load("model", "glm5")()
    cfg = ModelConfig(name="glm5", preset="tiny", seed=seed)
    adapter.save_checkpoint(adapter.build(cfg), path, tokenizer=adapter.tokenizer(cfg))
    return path


def server_args(checkpoint, kv_store: str) -> tuple[str, ...]:
    return ("--model", "glm5", "--model.checkpoint", str(checkpoint), "--inference.kv_store", kv_store,
            "--inference.max_model_len", "512", "--inference.kv_slots", "16", "--inference.max_batch_size", "8")


@contextlib.contextmanager
def pd_options(kv_store: str, tmp_dir):
    """The store options every server of the run shares (config keys): one disk directory, or
    a Mooncake master."""
    common = ("--inference.kv_store_options.block_size", str(BLOCK))
    if kv_store == "disk":
        yield (*common, "--inference.kv_store_options.root", str(tmp_dir / "kv"),
               "--inference.kv_store_options.shared", "true")
    else:
        from primerl_kv_mooncake.master import start_master

        with start_master() as master:
            yield (*common, *[a for k, v in {**master.options(), "segment_bytes": 64 << 20,
                                                "buffer_bytes": 16 << 20}.items()
                              for a in (f"--inference.kv_store_options.{k}", str(v))])


def mooncake_missing() -> str | None:
    try:
        from primerl_kv_mooncake.install import MooncakeUnavailable, import_store, master_binary
    except ImportError:
        return "the mooncake KV store plugin is not installed: pip install -e plugins/kv_stores/mooncake"
    try:
        import_store()
        master_binary()
    except MooncakeUnavailable as exc:
        return str(exc)
    return None


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("ckpt") / "model", seed=3)


@pytest.fixture(scope="module")
def plain(checkpoint):
    with InferenceServer(*server_args(checkpoint, "memory")) as s:
        yield s


@pytest.fixture(scope="module", params=["disk", "mooncake"])
def pd(request, checkpoint, tmp_path_factory):
    """(prefill server, decode server, the args and environment to start more like them)."""
    kv_store = request.param
    if kv_store == "mooncake" and (why := mooncake_missing()):
        pytest.skip(why)
    tmp = tmp_path_factory.mktemp(f"pd-{kv_store}")
    with pd_options(kv_store, tmp) as options:
        args = (*server_args(checkpoint, kv_store), *options)
        with InferenceServer(*args, "--inference.role", "prefill") as p, \
                InferenceServer(*args, "--inference.role", "decode") as d:
            yield p, d, args, kv_store


def greedy(prompt, n=1, max_tokens=MAX_TOKENS) -> dict:
    return {"model": "glm5", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "n": n, "return_routed_experts": True}


def experts(choice) -> np.ndarray:
    r = choice["routed_experts"]
    return np.frombuffer(base64.b64decode(r["data"]), dtype=r["dtype"]).reshape(r["shape"])


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def assert_same(pd_answer: dict, plain_answer: dict, prompt_len: int, max_tokens: int = MAX_TOKENS) -> None:
    """Token for token, logprob for logprob, expert for expert."""
    assert len(pd_answer["choices"]) == len(plain_answer["choices"])
    for a, b in zip(pd_answer["choices"], plain_answer["choices"]):
        assert a["token_ids"] == b["token_ids"] and len(a["token_ids"]) == max_tokens
        # the decode server ran the prompt's tail on KV loaded from blocks: the same numbers up to
        # float32 rounding (one forward over the prompt vs blocks then the tail)
        assert a["logprobs"]["token_logprobs"] == pytest.approx(b["logprobs"]["token_logprobs"], abs=1e-5)
        ea, eb = experts(a), experts(b)
        assert ea.shape == (prompt_len + max_tokens - 1, 3, 2) and np.array_equal(ea, eb)


def client_for(p_urls, d_urls) -> PDInferenceClient:
    return PDInferenceClient(p_urls, d_urls, RoundRobinRouter, probe_every_s=0.2, all_down_s=5.0)


def test_prefill_then_decode_answers_exactly_what_one_server_does(pd, plain):
    p, d, _, _ = pd
    hits0, gen0 = metric(d.url, "primerl_prefix_cache_hit_tokens_total"), metric(p.url, "primerl_generation_tokens_total")
    client = client_for([p.url], [d.url])

    async def go():
        try:
            await client.wait_ready()
            answers = [await client.completions(greedy(prompt)) for prompt in PROMPTS]
            # a group: n = 2 from one prompt (the second sample copies the first's loaded KV)
            group = await client.completions(greedy(GROUP, n=2))
            return answers, group, client.take_metrics()
        finally:
            await client.close()

    answers, group, metrics = asyncio.run(go())
    for prompt, answer in zip(PROMPTS, answers):
        assert_same(answer, httpx.post(plain.url + "/v1/completions", json=greedy(prompt), timeout=60).json(),
                    len(prompt))
    assert_same(group, httpx.post(plain.url + "/v1/completions", json=greedy(GROUP, n=2), timeout=60).json(),
                len(GROUP))
    # the decode server loaded every full block of every prompt (a block-aligned prompt's last
    # block up to its last token, which always runs); the prefill server sampled nothing
    need = [min(len(q) // BLOCK * BLOCK, len(q) - 1) for q in [*PROMPTS, GROUP]]
    hits = metric(d.url, "primerl_prefix_cache_hit_tokens_total") - hits0
    assert hits == sum(need) + (len(GROUP) - 1)  # + the second sample's copy of the first's prompt
    assert metric(p.url, "primerl_generation_tokens_total") == gen0
    assert metrics["inference/kv_reprefilled"] == 0 and metrics["inference/pd_whole"] == 0
    assert metrics["inference/prefill_up"] == 1 and metrics["inference/decode_up"] == 1


def test_chat_runs_in_two_phases_too(pd, plain):
    p, d, _, _ = pd
    body = {"model": "glm5", "messages": [{"role": "user", "content": "Reverse the words of this sentence, "
                                           "one long enough to fill a few KV blocks: " + "alpha beta gamma " * 6}],
            "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "logprobs": True, "n": 2,
            "return_routed_experts": True}
    client = client_for([p.url], [d.url])

    async def go():
        try:
            await client.wait_ready()
            return await client.chat(dict(body))
        finally:
            await client.close()

    answer = asyncio.run(go())
    ref = httpx.post(plain.url + "/v1/chat/completions", json=body, timeout=60).json()
    assert answer["prompt_token_ids"] == ref["prompt_token_ids"] and len(ref["prompt_token_ids"]) > 2 * BLOCK
    for a, b in zip(answer["choices"], ref["choices"]):
        assert a["token_ids"] == b["token_ids"]
        assert [t["logprob"] for t in a["logprobs"]["content"]] == pytest.approx(
            [t["logprob"] for t in b["logprobs"]["content"]], abs=1e-5)
        assert np.array_equal(experts(a), experts(b))


@pytest.mark.parametrize("pd", ["disk"], indirect=True)  # the miss paths do not depend on the store
def test_missing_kv_means_prefill_again_then_one_whole_server(pd, checkpoint, tmp_path):
    p, d, _, _ = pd
    # a decode phase whose prompt was never prefilled: 409 kv_missing, nothing generated
    never = list(range(250, 310))
    r = httpx.post(d.url + "/v1/completions", json={**greedy(never), "kv_transfer_params": {"do_remote_prefill": True}})
    assert r.status_code == 409 and r.json()["error"]["type"] == "kv_missing"
    # a request without kv_transfer_params runs whole on either server
    assert httpx.post(p.url + "/v1/completions", json=greedy(never), timeout=60).json()["choices"][0]["token_ids"]

    weights = save_checkpoint(tmp_path / "v5", seed=3)  # the same weights, as policy v5
    client = client_for([p.url], [d.url])

    async def go():
        try:
            await client.wait_ready()
            # only the decode server moved to v5: the prefill's v0 blocks never match its keys
            assert httpx.post(d.url + "/admin/weights", json={"path": str(weights), "version": 5},
                              timeout=60).status_code == 200
            late = await client.completions(greedy(PROMPTS[0]))
            missed = client.take_metrics()
            # both at v5: two phases again
            await client.load_weights(weights, 5)
            again = await client.completions(greedy(PROMPTS[0]))
            return late, missed, again, client.take_metrics()
        finally:
            await client.close()

    late, missed, again, metrics = asyncio.run(go())
    assert missed["inference/kv_reprefilled"] == 3 and missed["inference/pd_whole"] == 1
    assert late["choices"][0]["policy_versions"] == [5] * MAX_TOKENS
    assert metrics["inference/kv_reprefilled"] == 0 and metrics["inference/pd_whole"] == 0
    assert again["choices"][0]["token_ids"] == late["choices"][0]["token_ids"]
    assert again["choices"][0]["policy_versions"] == [5] * MAX_TOKENS


@pytest.mark.parametrize("pd", ["disk"], indirect=True)  # the failure paths do not depend on the store
def test_a_lost_server_costs_its_phase_only(pd, plain, checkpoint):
    """A second prefill and a second decode server, both SIGKILLed: every request still gets
    the plain server's answer; the decode phase is re-sent with the same KV (no new prefill)."""
    p, d, args, _ = pd
    extra_p = InferenceServer(*args, "--inference.role", "prefill").__enter__()
    extra_d = InferenceServer(*args, "--inference.role", "decode").__enter__()
    long = 200
    client = client_for([extra_p.url, p.url], [extra_d.url, d.url])

    async def go():
        try:
            await client.wait_ready()
            await client.load_weights(checkpoint, 7)  # one policy version on all four (an earlier test moved two)
            extra_p.proc.send_signal(signal.SIGKILL)  # a prefill server gone before the requests
            jobs = [asyncio.create_task(client.completions(greedy(q, max_tokens=long), session=f"s{i}"))
                    for i, q in enumerate(PROMPTS * 2)]
            deadline = time.monotonic() + 120
            while httpx.get(extra_d.url + "/admin/status").json()["running"] == 0:  # kill it mid-decode
                assert time.monotonic() < deadline, "the second decode server never decoded"
                await asyncio.sleep(0.05)
            extra_d.proc.send_signal(signal.SIGKILL)
            answers = await asyncio.wait_for(asyncio.gather(*jobs), 300)
            return answers, client.take_metrics()
        finally:
            await client.close()

    try:
        answers, metrics = asyncio.run(go())
    finally:
        for s in (extra_p, extra_d):
            with contextlib.suppress(subprocess.TimeoutExpired, OSError):
                s.proc.wait(timeout=30)
    for prompt, answer in zip(PROMPTS * 2, answers):
        ref = httpx.post(plain.url + "/v1/completions", json=greedy(prompt, max_tokens=long), timeout=120).json()
        assert_same(answer, ref, len(prompt), long)
    assert metrics["inference/resent"] >= 1  # the decode phases lost with the second decode server
    assert metrics["inference/kv_reprefilled"] == 0 and metrics["inference/pd_whole"] == 0
    assert metrics["inference/prefill_up"] == 1 and metrics["inference/decode_up"] == 1


def test_a_server_without_a_shared_store_refuses_a_phase(plain):
    r = httpx.post(plain.url + "/v1/completions",
                   json={**greedy(PROMPTS[0]), "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 400 and "--inference.kv_store disk" in r.json()["error"]["message"]


def test_a_private_disk_directory_refuses_a_phase(tmp_path):
    from primerl_embedded.engine import RequestError, SamplingParams
    from primerl_embedded.pd import KVHandoff
    from primerl_kv_disk.store import DiskStore

    with pytest.raises(RequestError, match="shared = true"):
        KVHandoff(DiskStore(root=tmp_path)).phase("decode").check(SamplingParams(), prefix_reuse=True)
    KVHandoff(DiskStore(root=tmp_path, shared=True)).phase("prefill").check(SamplingParams(), prefix_reuse=True)
    with pytest.raises(RequestError, match="phase must be 'prefill' or 'decode'"):
        KVHandoff(DiskStore(root=tmp_path, shared=True)).phase("both")


def test_the_engine_scheduler_knows_no_prefill_decode_rules():
    """P/D wraps the engine (its phases are objects a request brings, primerl_embedded.pd):
    the scheduler names neither the handoff nor the phases."""
    import re

    import primerl_embedded.engine as engine

    src = Path(engine.__file__).read_text()
    assert not re.findall(r"handoff|KV_MISSING|kv_missing|phase == |\"prefill\"|\"decode\"", src)


def test_a_shared_store_is_chosen_when_none_was_and_a_per_process_one_is_refused():
    pd = ["--inference.prefill_replicas", "1", "--inference.decode_replicas", "1", "--dry-run"]
    base = [sys.executable, "-m", "primerl.cli", "run", "--model", "glm5", "--env", "wordle"]
    r = subprocess.run([*base, *pd], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    (note,) = [line for line in r.stderr.splitlines() if line.startswith("note:")]
    assert "using inference.kv_store = 'disk'" in note and "set --inference.kv_store to choose" in note
    assert 'kv_store = "disk"' in r.stdout  # the resolved config the processes get
    r = subprocess.run([*base, *pd, "--inference.kv_store", "memory"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "inference.kv_store = 'memory' (from " in r.stderr and "keeps KV inside each server's process" in r.stderr
    assert "--inference.kv_store disk" in r.stderr and "--inference.kv_store mooncake" in r.stderr
    r = subprocess.run([*base, "--inference.decode_replicas", "2", "--inference.kv_store", "disk", "--dry-run"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "needs inference.prefill_replicas too" in r.stderr


def test_vllm_roles_map_to_its_kv_connector_roles(tmp_path):
    """Prefill/decode on the vllm backend (GPU; untested here): the server's role becomes its
    KV connector's kv_role, and router replay with those connectors is refused up front."""
    pytest.importorskip("primerl_vllm", reason="the vllm backend plugin is not installed")
    from primerl_vllm.config import VllmConfig
    from primerl_vllm.launch import vllm_command

    from primerl.config import RunConfig, TrainerConfig

    def command(**inference) -> dict:
        run = RunConfig(model=ModelConfig(name="qwen3-moe"), inference=VllmConfig(device="cuda", **inference),
                        trainer=TrainerConfig(), output_dir=str(tmp_path))
        cmd = vllm_command(run, tmp_path, 1234)
        return json.loads(cmd[cmd.index("--kv-transfer-config") + 1])

    assert command(role="prefill") == {"kv_connector": "NixlConnector", "kv_role": "kv_producer"}
    assert command(role="decode") == {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}
    mine = {"kv_connector": "MooncakeConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"x": 1}}
    assert command(role="decode", kv_transfer_config=json.dumps(mine)) == {**mine, "kv_role": "kv_consumer"}

    r = subprocess.run([sys.executable, "-m", "primerl.cli", "run", "--model", "qwen3-moe", "--env", "reverse-text",
                        "--inference.backend", "vllm", "--inference.device", "cuda", "--inference.prefill_replicas",
                        "1", "--inference.decode_replicas", "1", "--dry-run"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "refuses to return routed experts" in r.stderr
    assert "--inference.backend embedded" in r.stderr
