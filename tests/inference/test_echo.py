"""Prompt log-probabilities (``echo`` + ``logprobs``): the engine's scores against a plain
forward, OpenAI's response shape, and lm-evaluation-harness's multiple-choice tasks run
against a real ``primerl inference``."""

import json
import os
import subprocess
import sys
import textwrap

import httpx
import pytest
import torch
from primerl_embedded.engine import Engine, SamplingParams

from primerl.models import ModelConfig
from primerl.registry import get_registry
from primerl.sampling import token_logprobs


@pytest.fixture(scope="module")
def setup():
    adapter = get_registry().load("model", "glm5")()
    cfg = ModelConfig(name="glm5", preset="tiny", seed=3)
    return adapter, adapter.build(cfg), adapter.tokenizer(cfg)


def make_engine(model, tok, **kw):
    return Engine(model, eos_token_ids=[tok.eos_token_id], max_batch_size=8, max_model_len=128, kv_slots=8, **kw)


def forward_logprobs(model, ids: list[int], temperature: float) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for i >= 1 from one plain forward (the trainer's function)."""
    n = len(ids)
    with torch.no_grad():
        logits = model(torch.tensor([ids]), torch.arange(n)[None], torch.tensor([n])).logits[0]
    return token_logprobs(logits[:-1], torch.tensor(ids[1:]), temperature)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_prompt_logprobs_equal_a_plain_forward(setup, temperature):
    _, model, tok = setup
    eng = make_engine(model, tok)
    prompt = tok.encode("the quick brown fox")
    (seq,) = eng.generate(prompt, SamplingParams(max_tokens=0, temperature=temperature, prompt_logprobs=2))
    assert seq.output_ids == [] and seq.finish_reason == "length"  # max_tokens=0: scored, nothing generated
    assert seq.prompt_logprobs[0] is None and len(seq.prompt_logprobs) == len(prompt)
    ref = forward_logprobs(model, prompt, temperature)
    torch.testing.assert_close(torch.tensor(seq.prompt_logprobs[1:]), ref, atol=1e-5, rtol=0)
    for lp, top in zip(seq.prompt_logprobs[1:], seq.prompt_top_logprobs[1:]):
        assert len(top) == 2 and lp <= max(top.values()) + 1e-6
    assert eng.stats.prompt_tokens == len(prompt) and eng.stats.generated_tokens == 0


def test_scoring_a_prompt_changes_no_sampled_token(setup):
    """Echo rows run alone with every position's logits; what they sample is what a plain
    request samples, n > 1 siblings share the leader's scores, and the scored prompt is
    kept for prefix reuse like any other."""
    _, model, tok = setup
    prompt = tok.encode("Reverse: hello")
    params = dict(max_tokens=6, temperature=1.0, seed=11, n=3, ignore_eos=True, logprobs=0)
    plain = make_engine(model, tok).generate(prompt, SamplingParams(**params))
    eng = make_engine(model, tok)
    others = [eng.submit(tok.encode(p), SamplingParams(max_tokens=5, temperature=0)) for p in ("ab", "a longer one")]
    scored = eng.submit(prompt, SamplingParams(**params, prompt_logprobs=1))
    while eng.has_work():
        eng.step()
    assert [s.output_ids for s in scored] == [s.output_ids for s in plain]
    for a, b in zip(scored, plain):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    assert all(s.prompt_logprobs is scored[0].prompt_logprobs for s in scored)
    assert all(len(o[0].output_ids) == 5 for o in others)
    hits = eng.stats.prefix_hit_tokens
    eng.generate(prompt + tok.encode("!"), SamplingParams(max_tokens=1, temperature=0))
    assert eng.stats.prefix_hit_tokens - hits >= len(prompt)
    (one,) = eng.generate(tok.encode("x"), SamplingParams(max_tokens=0, prompt_logprobs=0))
    assert one.prompt_logprobs == [None]  # nothing predicts a prompt's first token


# ---- over HTTP ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(setup, tmp_path_factory):
    """The fixture model as an HF checkpoint directory (weights + tokenizer), served below."""
    adapter, model, tok = setup
    path = tmp_path_factory.mktemp("ckpt") / "glm5"
    adapter.save_checkpoint(model, path, tokenizer=tok)
    return path


@pytest.fixture(scope="module")
def server(checkpoint):
    from conftest import InferenceServer

    with InferenceServer("--model", "glm5", "--checkpoint", str(checkpoint), "--inference.max_model_len", "256") as s:
        yield s.url


@pytest.mark.slow
def test_openai_echo_returns_the_prompt_and_its_logprobs(server, setup):
    from openai import OpenAI

    from primerl.serving.protocol import CompletionChoice, CompletionLogprobs

    _, model, tok = setup
    client = OpenAI(base_url=server + "/v1", api_key="none")
    prompt = "Question: 2 + 2 =\nAnswer: 4"
    ids = tok.encode(prompt)
    r = client.completions.create(model="glm5", prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    (c,) = r.choices
    assert c.text == prompt and c.finish_reason == "length" and c.model_extra["token_ids"] == []
    lp = c.logprobs
    assert "".join(lp.tokens) == prompt and len(lp.token_logprobs) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset == list(range(len(ids)))  # one byte, one character, one token
    torch.testing.assert_close(torch.tensor(lp.token_logprobs[1:]), forward_logprobs(model, ids, 1.0),
                               atol=1e-4, rtol=0)
    assert all(len(t) == 1 and v <= max(t.values()) for v, t in zip(lp.token_logprobs[1:], lp.top_logprobs[1:]))
    # with generated tokens: the prompt's entries, then the completion's; several prompts at once
    body = {"prompt": [ids, ids[:5]], "max_tokens": 3, "echo": True, "logprobs": 0, "temperature": 0}
    out = httpx.post(server + "/v1/completions", json=body, timeout=60).json()
    for choice, p in zip(out["choices"], [ids, ids[:5]]):
        assert set(CompletionChoice.__required_keys__) <= set(choice)
        assert set(choice["logprobs"]) == set(CompletionLogprobs.__required_keys__)
        assert choice["logprobs"]["top_logprobs"] is None
        lps = choice["logprobs"]["token_logprobs"]
        assert len(lps) == len(p) + 3 and lps[0] is None and all(v is not None for v in lps[1:])
        assert lps[len(p):] == pytest.approx(forward_logprobs(model, p + choice["token_ids"], 1.0)[len(p) - 1:].tolist(),
                                             abs=1e-4)
        assert choice["text"] == tok.decode(p) + tok.decode(choice["token_ids"])
    no_echo = httpx.post(server + "/v1/completions", json={"prompt": "x", "max_tokens": 0}).json()
    assert "max_tokens" in no_echo["error"]["message"] and "echo" in no_echo["error"]["message"]


MC_ROWS = [
    {"question": "Which is a fruit?", "choices": ["apple", "hammer", "cloud"], "answer": 0},
    {"question": "Reverse 'abc'", "choices": ["cba", "abc", "bac"], "answer": 0},
    {"question": "2 + 2 =", "choices": ["3", "4", "22", "five"], "answer": 1},
    {"question": "Color of the sky?", "choices": ["blue", "green"], "answer": 0},
]


@pytest.mark.slow
@pytest.mark.parametrize("tokenized", [True, False], ids=["token-ids", "text"])
def test_lm_eval_multiple_choice_scores_are_the_servers_logprobs(server, checkpoint, setup, tmp_path, tokenized):
    """lm-evaluation-harness (``--model local-completions``) runs a multiple-choice task, from a
    local YAML and JSONL with no download, against ``primerl inference``; every choice's
    score is the server's own sum of continuation logprobs, which is the model's."""
    pytest.importorskip("lm_eval")
    _, model, tok = setup
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in MC_ROWS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "primerl_mc.yaml").write_text(textwrap.dedent(f"""\
        task: primerl_mc
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {data}
        test_split: test
        output_type: multiple_choice
        doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
        doc_to_choice: "{{{{choices}}}}"
        doc_to_target: answer
        metric_list:
          - metric: acc
            aggregation: mean
            higher_is_better: true
    """))
    out = tmp_path / "out"
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "hf"), "TOKENIZERS_PARALLELISM": "false"}
    args = [f"base_url={server}/v1/completions", "model=glm5", f"tokenizer={checkpoint}",
            f"tokenized_requests={tokenized}"]
    r = subprocess.run(
        [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions", "--model_args", ",".join(args),
         "--tasks", "primerl_mc", "--include_path", str(tasks), "--output_path", str(out), "--log_samples",
         "--batch_size", "1" if tokenized else "4"],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (samples,) = out.rglob("samples_primerl_mc_*.jsonl")
    (results,) = out.rglob("results_*.json")
    docs = sorted((json.loads(line) for line in samples.read_text().splitlines()), key=lambda d: d["doc_id"])
    assert len(docs) == len(MC_ROWS)
    correct = 0
    for doc, row in zip(docs, MC_ROWS):
        context = tok.encode(f"Question: {row['question']}\nAnswer:")
        ours = []
        for choice, (score, greedy) in zip(row["choices"], doc["filtered_resps"]):
            ids = context + tok.encode(" " + choice)
            body = {"prompt": [ids], "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}
            lp = httpx.post(server + "/v1/completions", json=body, timeout=60).json()["choices"][0]["logprobs"]
            served = sum(lp["token_logprobs"][len(context):])
            assert float(score) == pytest.approx(served, abs=1e-9)  # lm-eval's score is the server's sum
            assert served == pytest.approx(forward_logprobs(model, ids, 1.0)[len(context) - 1:].sum().item(), abs=1e-4)
            is_greedy = all(v == max(t.values()) for v, t in zip(lp["token_logprobs"][len(context):],
                                                                 lp["top_logprobs"][len(context):]))
            assert str(is_greedy) == str(greedy)
            ours.append(served)
        correct += max(range(len(ours)), key=ours.__getitem__) == row["answer"]
        assert doc["acc"] == float(max(range(len(ours)), key=ours.__getitem__) == row["answer"])
    acc = json.loads(results.read_text())["results"]["primerl_mc"]["acc,none"]
    assert acc == pytest.approx(correct / len(MC_ROWS))
