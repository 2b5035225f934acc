"""``POST /inference/v1/generate`` (vLLM's token-in API) on the embedded backend, called the
way verifiers' training clients call it: ``renderers.client.generate``."""

import asyncio
import base64

import httpx
import numpy as np
import pytest
from conftest import InferenceServer

pytestmark = pytest.mark.slow
renderers = pytest.importorskip("renderers")


@pytest.fixture(scope="module")
def server():
    with InferenceServer("--model", "glm5", "--inference.max_model_len", "256") as s:
        yield s.url


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def test_renderers_client_generate_gets_tokens_logprobs_versions_and_experts(server):
    """The sampled ids and logprobs renderers parses equal what the server's own prompt
    scoring (``echo``) gives the same tokens; each choice names the policy version of every
    token and the experts of every token the engine ran."""
    from openai import AsyncOpenAI
    from renderers.client import generate
    from renderers.default import DefaultRenderer

    from primerl.tokenizer import byte_tokenizer

    renderer = DefaultRenderer(byte_tokenizer())
    client = AsyncOpenAI(base_url=server + "/v1", api_key="none")
    out = asyncio.run(generate(client=client, renderer=renderer, messages=[{"role": "user", "content": "reverse: abc"}],
                               model="glm5", sampling_params={"max_tokens": 12, "temperature": 1.0, "seed": 5},
                               cache_salt="episode-1"))
    prompt, completion = out["prompt_ids"], out["completion_ids"]
    assert completion and len(out["completion_logprobs"]) == len(completion)
    assert prompt == renderer.render_ids([{"role": "user", "content": "reverse: abc"}], add_generation_prompt=True)
    scored = httpx.post(server + "/v1/completions", json={
        "prompt": prompt + completion, "max_tokens": 0, "echo": True, "logprobs": 0}, timeout=60).json()
    echo = scored["choices"][0]["logprobs"]["token_logprobs"][len(prompt):]
    np.testing.assert_allclose(out["completion_logprobs"], echo, atol=1e-5, rtol=0)

    body = {"model": "glm5", "token_ids": prompt, "return_routed_experts": True,
            "sampling_params": {"max_tokens": 6, "temperature": 0.7, "seed": 1, "logprobs": 2}}
    raw = httpx.post(server + "/inference/v1/generate", json=body, timeout=60).json()
    assert raw["prompt_token_ids"] == prompt and raw["request_id"]
    (choice,) = raw["choices"]
    ids = choice["token_ids"]
    assert choice["policy_versions"] == [0] * len(ids)
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in ids]
    assert all(len(c["top_logprobs"]) == 2 for c in content)
    experts = choice["routed_experts"]
    rows = np.frombuffer(base64.b64decode(experts["data"]), dtype=experts["dtype"]).reshape(experts["shape"])
    assert rows.shape[0] == len(prompt) + len(ids) - 1 and experts["start"] == 0  # every token run
    assert rows.shape[1:] == (3, 2)  # the tiny GLM-5's MoE layers, top-2


def test_a_cache_salt_shares_prefixes_only_with_the_same_salt(server):
    prompt = list(range(40, 100))
    hits = "primerl_prefix_cache_hit_tokens_total"

    def run(salt):
        body = {"token_ids": prompt, "sampling_params": {"max_tokens": 2, "temperature": 0}}
        if salt is not None:
            body["cache_salt"] = salt
        before = metric(server, hits)
        assert httpx.post(server + "/inference/v1/generate", json=body, timeout=60).status_code == 200
        return metric(server, hits) - before

    run("a")
    assert run("a") >= len(prompt) - 1  # the same salt: the prompt's KV is reused
    assert run("b") == 0 and run(None) == 0  # another salt, or none: computed afresh
    assert run(None) >= len(prompt) - 1 and run("b") >= len(prompt) - 1


def test_scoring_a_prompt_answers_vllms_prompt_logprobs(server):
    prompt = [5, 6, 7, 8, 9]
    body = {"token_ids": prompt, "sampling_params": {"max_tokens": 0, "prompt_logprobs": 0}}
    r = httpx.post(server + "/inference/v1/generate", json=body, timeout=60).json()
    echo = httpx.post(server + "/v1/completions", json={"prompt": prompt, "max_tokens": 0, "echo": True,
                                                        "logprobs": 0}).json()["choices"][0]["logprobs"]
    assert r["prompt_logprobs"][0] is None
    got = [d[str(t)]["logprob"] for t, d in zip(prompt[1:], r["prompt_logprobs"][1:])]
    np.testing.assert_allclose(got, echo["token_logprobs"][1:], atol=1e-6, rtol=0)
    assert r["choices"][0]["token_ids"] == []


@pytest.mark.parametrize("body,fragment", [
    ({"token_ids": []}, "token_ids"),
    ({"token_ids": [1, 2], "stream": True}, "streaming is not supported"),
    ({"token_ids": [1, 2], "sampling_params": {"max_tokens": 0}}, "0 only with prompt_logprobs"),
    ({"token_ids": [1, 999999]}, "prompt token ids must be in"),
    ({"token_ids": [1, 2], "sampling_params": {"max_tokens": 1000}}, "exceeds the maximum model length 256"),
])
def test_bad_generate_requests_are_400_naming_the_problem(server, body, fragment):
    r = httpx.post(server + "/inference/v1/generate", json=body, timeout=30)
    assert r.status_code == 400 and fragment in r.json()["error"]["message"], r.text


def test_models_reports_max_model_len(server):
    (card,) = httpx.get(server + "/v1/models").json()["data"]
    assert card["max_model_len"] == 256
