"""The verifiers bridge, offline: a local verifiers environment (examples/verifiers-env)
run by verifiers' own rollout loop against a real `primerl inference` process."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("verifiers")
pytest.importorskip("vf_guess_number")

from conftest import InferenceServer

from primerl.envs.agent import Endpoint, interleave
from primerl.envs.multiturn import prompt_ids, turn_suffix
from primerl.errors import ConfigError

EOS = 256  # the byte tokenizer's <|endoftext|>


def config(**kw):
    from primerl_verifiers.env import VerifiersConfig

    return VerifiersConfig(**{"name": "verifiers", "id": "vf-guess-number", **kw})


def test_tasks_are_the_verifiers_dataset():
    from primerl_verifiers.env import VerifiersEnv

    tasks = list(VerifiersEnv(config(args={"num_examples": 12})).tasks("train"))
    assert len(tasks) == 12
    assert tasks[0].id == "vf-guess-number/0"
    assert tasks[0].prompt[0]["role"] == "user" and "integer from 1 to 9" in tasks[0].prompt[0]["content"]
    assert tasks[0].answer == tasks[0].info["vf_input"]["answer"]


def test_a_missing_or_unknown_id_is_a_clear_error():
    from primerl_verifiers.env import VerifiersEnv

    from primerl.config import ConfigSources, load_config

    with pytest.raises(ConfigError, match="env.id.*--env.id vf-guess-number"):
        load_config(ConfigSources(overrides=[("env.name", "verifiers")]))
    with pytest.raises(ValueError, match="vf-no-such-env.*install"):
        list(VerifiersEnv(config(id="vf-no-such-env")).tasks("train"))


@pytest.fixture(scope="module")
def chain_checkpoint(tmp_path_factory):
    """A tiny GLM-5 whose greedy answer to any chat turn is "5" then EOS.

    Every output projection is zero, so each position's final hidden state is its token's
    embedding; the embeddings and lm_head are set so that "\\n" (the end of the generation
    prompt) predicts "5" and "5" predicts EOS. The model still runs every real code path
    (MLA, DSA, routers pick experts, the engine's cache), it just has a known policy.
    """
    import torch

    from primerl.models import ModelConfig
    from primerl.registry import get_registry

    adapter = get_registry().load("model", "glm5")()
    cfg = ModelConfig(name="glm5", preset="tiny", seed=0)
    model = adapter.build(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "down_proj")):
                p.zero_()
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        emb.zero_()
        emb[:, 0] = 1.0
        emb[ord("\n")] = torch.nn.functional.one_hot(torch.tensor(1), emb.shape[1]).float()
        emb[ord("5")] = torch.nn.functional.one_hot(torch.tensor(2), emb.shape[1]).float()
        head.zero_()
        head[ord("5"), 1] = 10.0
        head[EOS, 2] = 10.0
    path = tmp_path_factory.mktemp("chain") / "ckpt"
    adapter.save_checkpoint(model, path, tokenizer=adapter.tokenizer(cfg))
    return path


@pytest.fixture(scope="module")
def server(chain_checkpoint):
    with InferenceServer("--model", "glm5", "--checkpoint", str(chain_checkpoint),
                         "--inference.max_model_len", "512") as s:
        yield s


def run(server, client: str, n: int = 2):
    """One group per answer 5 and per another answer, greedy, with routed experts."""
    from primerl_verifiers.env import VerifiersEnv

    env = VerifiersEnv(config(client=client, args={"num_examples": 40, "max_turns": 3}))
    tasks = list(env.tasks("train"))
    hit = next(t for t in tasks if t.answer == "5")
    miss = next(t for t in tasks if t.answer != "5")
    endpoint = Endpoint(base_url=server.url + "/v1", model="glm5", max_tokens=8, temperature=0.0,
                        max_model_len=512, return_routed_experts=True)
    return hit, env.run_group(hit, endpoint, n), miss, env.run_group(miss, endpoint, n)


@pytest.mark.slow
def test_episodes_are_token_exact_across_turns(server):
    """Turn 2+ go out as token ids (the engine's own tokens plus the rendered env turn), so
    each episode is one sample whose tokens are exactly what the model saw and produced."""
    from primerl.tokenizer import byte_tokenizer

    tok = byte_tokenizer()
    hit, hits, miss, misses = run(server, "tokens")
    for ep in hits:  # "5" on the first try: reward 1, one call
        assert ep.reward == 1.0 and ep.error is None and len(ep.calls) == 1
        assert ep.calls[0].completion_ids == [ord("5"), EOS]
    for ep in misses:  # "5" three times: never right, each turn answered "higher" or "lower"
        assert ep.reward == 0.0 and len(ep.calls) == 3
        messages = list(miss.prompt)
        expected = prompt_ids(tok, messages)
        hint = "higher" if 5 < int(miss.answer) else "lower"
        for call in ep.calls:
            assert call.prompt_ids == expected
            assert call.completion_ids == [ord("5"), EOS] and call.versions == [0, 0]
            assert all(lp > -1e-3 for lp in call.logprobs)  # greedy on a sharp policy
            messages = messages + [{"role": "assistant", "content": "5"}]
            expected = call.prompt_ids + call.completion_ids + turn_suffix(tok, messages, [{"role": "user", "content": hint}])
            messages = messages + [{"role": "user", "content": hint}]
        (sample,) = interleave(ep.calls)  # the extension property holds: one sample
        last = ep.calls[-1]
        assert sample.tokens == last.prompt_ids + last.completion_ids
        assert [t for t, m in zip(sample.tokens, sample.loss_mask) if m] == [ord("5"), EOS] * 3
        routed = last.routed_experts
        assert routed["dtype"] == "uint8" and routed["start"] == 0
        assert routed["shape"][0] >= len(sample.tokens) - 1 and routed["shape"][1:] == [3, 2]
        assert list(sample.routed_experts.shape) == routed["shape"]


def test_message_turns_split_where_the_tokens_stop_extending(server):
    """With --env.client messages every turn is re-rendered from text; the chat template
    does not write the EOS the model sampled, so each turn becomes its own sample."""
    _, _, _, misses = run(server, "messages", n=1)
    (ep,) = misses
    samples = interleave(ep.calls)
    assert len(ep.calls) == 3 and len(samples) == 3
    for call, sample in zip(ep.calls, samples):
        assert sample.tokens == call.prompt_ids + call.completion_ids
        assert sample.sampled_tokens == 2


@pytest.mark.slow
def test_primerl_run_trains_on_a_verifiers_env(tmp_path):
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "primerl.cli", "run", "--model", "glm5", "--env", "verifiers",
                        "--env.id", "vf-guess-number", "--env.args.max_turns", "2", "--max-steps", "2",
                        "--orchestrator.batch_size", "16", "--orchestrator.max_tokens", "16",
                        "--trainer.seq_len", "512", "--trainer.router_replay", "true", "--output-dir", str(out)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    assert rows[0]["env/num_turns"] >= 1  # the verifiers rubric's metrics, averaged per episode
    from primerl.rundir import RunDir
    from primerl.samples import read_batch

    samples = read_batch(RunDir(out).batch(1)).samples
    assert {s.task_id.split("/")[0] for s in samples} == {"vf-guess-number"}
    for s in samples:
        assert len(s.tokens) == len(s.loss_mask) == len(s.logprobs) == len(s.versions)
        assert s.routed_experts is not None and s.routed_experts.shape[1:] == (3, 2)
