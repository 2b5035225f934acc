"""`primerl inference` as users run it: a real process, the official openai client."""

import time

import httpx
import pytest
from conftest import InferenceServer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    with InferenceServer("--model", "glm5", "--inference.max_model_len", "256") as s:
        yield s.url


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
    ({"prompt": "x", "max_tokens": 100000}, "exceeds the maximum model length"),
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
    out = httpx.post(server + "/v1/completions", json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True}, timeout=60).json()
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


def test_tokenize_and_detokenize(server):
    """vLLM's /tokenize: a conversation gives the ids a chat request would prefill."""
    messages = [{"role": "user", "content": "hi"}]
    chat = httpx.post(server + "/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()
    r = httpx.post(server + "/tokenize", json={"model": "glm5", "messages": messages}).json()
    assert r["tokens"] == chat["prompt_token_ids"] and r["count"] == len(r["tokens"]) and r["max_model_len"] == 256
    no_prompt = httpx.post(server + "/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert r["tokens"][: no_prompt["count"]] == no_prompt["tokens"] and no_prompt["count"] < r["count"]
    text = httpx.post(server + "/tokenize", json={"prompt": "héllo"}).json()["tokens"]
    assert httpx.post(server + "/detokenize", json={"tokens": text}).json()["prompt"] == "héllo"
    bad = httpx.post(server + "/tokenize", json={"prompt": "x", "messages": messages})
    assert bad.status_code == 400 and "exactly one" in bad.json()["error"]["message"]
    assert httpx.post(server + "/detokenize", json={"tokens": [10**6]}).status_code == 400


def test_chat_completion_from_tokens_matches_the_chat_request(server):
    """/v1/chat/completions/tokens samples from the given ids exactly as a chat request from its messages."""
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "he"}, {"type": "text", "text": "y"}]}],
            "max_tokens": 8, "temperature": 0, "logprobs": True, "return_token_ids": True}
    chat = httpx.post(server + "/v1/chat/completions", json=body, timeout=60).json()
    ids = httpx.post(server + "/tokenize", json={"messages": [{"role": "user", "content": "hey"}]}).json()["tokens"]
    assert chat["prompt_token_ids"] == ids  # text parts are joined
    tok = httpx.post(server + "/v1/chat/completions/tokens", json={**body, "tokens": ids}, timeout=60).json()
    assert tok["prompt_token_ids"] == ids
    assert tok["choices"][0]["token_ids"] == chat["choices"][0]["token_ids"]
    assert [c["logprob"] for c in tok["choices"][0]["logprobs"]["content"]] == pytest.approx(
        [c["logprob"] for c in chat["choices"][0]["logprobs"]["content"]], abs=1e-5)
    image = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
    r = httpx.post(server + "/v1/chat/completions", json=image)
    assert r.status_code == 400 and "text content" in r.json()["error"]["message"]


def test_tools_are_rendered_into_the_prompt(server):
    tools = [{"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                               "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}]
    messages = [{"role": "user", "content": "1+1?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "2"}]
    ids = httpx.post(server + "/tokenize", json={"messages": messages, "tools": tools}).json()["tokens"]
    text = httpx.post(server + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert '{"name": "add", "description": "Add two integers."' in text
    assert '<|assistant|>\n<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call><|observation|>\n2' in text
    r = httpx.post(server + "/v1/chat/completions", json={"messages": messages, "tools": [{"type": "function", "function": {}}]})
    assert r.status_code == 400 and "name" in r.json()["error"]["message"]


def test_responses_carry_the_backend_contract_fields(server, tmp_path):
    """Every response record of primerl.serving.protocol (what the orchestrator reads from any
    backend) is in the embedded server's answers, with nothing unaccounted for where the record
    is closed."""
    from primerl.serving import protocol as api

    def check(record, obj, closed=True):
        assert set(record.__required_keys__) <= set(obj), (record.__name__, sorted(obj))
        if closed:
            assert set(obj) <= set(record.__required_keys__) | set(record.__optional_keys__), record.__name__

    body = {"max_tokens": 3, "logprobs": 1, "return_routed_experts": True, "n": 2, "seed": 0}
    comp = httpx.post(server + api.COMPLETIONS, json={**body, "prompt": "hi"}, timeout=60).json()
    check(api.CompletionResponse, comp)
    check(api.Usage, comp["usage"])
    for c in comp["choices"]:
        check(api.CompletionChoice, c)
        check(api.CompletionLogprobs, c["logprobs"])
        check(api.RoutedExperts, c["routed_experts"])
        assert c["routed_experts"]["shape"][0] == len(c["prompt_token_ids"]) + len(c["token_ids"]) - 1
        assert len(c["policy_versions"]) == len(c["token_ids"]) == len(c["logprobs"]["token_logprobs"])
    chat = httpx.post(server + api.CHAT_COMPLETIONS, json={**body, "logprobs": True, "top_logprobs": 1,
                                                           "messages": [{"role": "user", "content": "hi"}]},
                      timeout=60).json()
    check(api.ChatCompletionResponse, chat)
    for c in chat["choices"]:
        check(api.ChatChoice, c)
        check(api.AssistantMessage, c["message"])
        check(api.ChatTokenLogprob, c["logprobs"]["content"][0])
        check(api.TopLogprob, c["logprobs"]["content"][0]["top_logprobs"][0])
        assert c["routed_experts"]["shape"][0] == len(chat["prompt_token_ids"]) + len(c["token_ids"]) - 1
    check(api.Health, httpx.get(server + api.HEALTH).json())
    check(api.AdminStatus, httpx.get(server + api.ADMIN_STATUS).json())
    check(api.PauseResponse, httpx.post(server + api.ADMIN_RESUME).json())
    check(api.TokenizeResponse, httpx.post(server + api.TOKENIZE, json={"prompt": "hi"}).json())
    check(api.DetokenizeResponse, httpx.post(server + api.DETOKENIZE, json={"tokens": [1, 2]}).json())
    models = httpx.get(server + api.MODELS).json()
    check(api.ModelList, models)
    check(api.ModelCard, models["data"][0])
    bad = httpx.post(server + api.ADMIN_WEIGHTS, json={"path": str(tmp_path / "none")})
    check(api.ErrorResponse, bad.json())
    check(api.ErrorBody, bad.json()["error"])


def test_the_embedded_backend_is_an_inference_backend():
    import inspect

    from primerl.inference import InferenceBackend
    from primerl.registry import get_registry

    backend = get_registry().load("inference_backend", "embedded")
    for name in ("serve",):
        assert list(inspect.signature(getattr(backend, name)).parameters)[1:] == \
            list(inspect.signature(getattr(InferenceBackend, name)).parameters)[1:]
