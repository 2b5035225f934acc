"""``--model hf``: checkpoints transformers wrote, trained and served through transformers'
own modeling code, against transformers itself.

Each architecture is a tiny checkpoint with a tokenizer of its own (tests/hf_checkpoints.py):
llama, mixtral and gpt_oss (no primerl plugin; gpt_oss mixes sliding-window and full
attention layers, with attention sinks) and qwen3 and minimax_m2 (which have one).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import InferenceServer
from hf_checkpoints import ARCHS, write_checkpoint

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from primerl.models import ModelConfig
from primerl.registry import get_registry

TOL = 1e-5


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {a: write_checkpoint(a, root / a) for a in ARCHS}


@pytest.fixture(scope="module")
def adapter():
    return get_registry().load("model", "hf")()


def reference(ckpt):
    return transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()


def build(adapter, ckpt):
    return adapter.build(ModelConfig(name="hf", checkpoint=str(ckpt))).eval()


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_rows_ragged_cached_steps_and_last_logits_match_transformers(arch, checkpoints, adapter):
    """Packed rows (two sequences in one row), a cached forward mixing a decode row, a
    continued prefill and a fresh prefill, and last-token logits: each as transformers'
    plain forward over each whole sequence (44 tokens: past gpt_oss's window of 8); logits at
    a mask's positions as the full logits at them."""
    hf, model = reference(checkpoints[arch]), build(adapter, checkpoints[arch])
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, hf.config.vocab_size, (n,), generator=g) for n in (31, 44, 17)]
    with torch.no_grad():
        ref = [hf(input_ids=s[None]).logits[0] for s in seqs]
        ids, pos, seg = (torch.zeros(2, 48, dtype=torch.long) for _ in range(3))
        ids[0] = torch.cat([seqs[0], seqs[2]])
        pos[0], seg[0, 31:] = torch.cat([torch.arange(31), torch.arange(17)]), 1
        ids[1, :44], pos[1, :44] = seqs[1], torch.arange(44)
        out = model(ids, pos, torch.tensor([48, 44]), segment_ids=seg).logits
        # the trainer's form: logits at the loss's positions only, rows selecting different columns
        only = torch.zeros(2, 48, dtype=torch.bool)
        only[0, 20:40], only[1, 5:9], only[1, 42] = True, True, True
        selected = model(ids, pos, torch.tensor([48, 44]), segment_ids=seg, logits_for=only).logits
    torch.testing.assert_close(selected, out[only], atol=TOL, rtol=0)
    torch.testing.assert_close(out[0, :31], ref[0], atol=TOL, rtol=0)
    torch.testing.assert_close(out[0, 31:], ref[2], atol=TOL, rtol=0)
    torch.testing.assert_close(out[1, :44], ref[1], atol=TOL, rtol=0)

    def step(cache, rows, last=False):
        S = max(len(t) for *_, t in rows)
        ids, pos = torch.zeros(len(rows), S, dtype=torch.long), torch.zeros(len(rows), S, dtype=torch.long)
        for b, (_, past, t) in enumerate(rows):
            ids[b, : len(t)], pos[b, : len(t)] = t, torch.arange(past, past + len(t))
        with torch.no_grad():
            return model(ids, pos, torch.tensor([len(t) for *_, t in rows]), cache=cache,
                         slots=torch.tensor([s for s, *_ in rows]), past_lens=torch.tensor([p for _, p, _ in rows]),
                         logits_for="last" if last else "all").logits

    cache = model.new_cache(num_slots=3, max_len=64)
    out1 = step(cache, [(0, 0, seqs[0][:30]), (1, 0, seqs[1][:11])])
    out2 = step(cache, [(0, 30, seqs[0][30:]), (1, 11, seqs[1][11:]), (2, 0, seqs[2])])
    torch.testing.assert_close(out1[0, :30], ref[0][:30], atol=TOL, rtol=0)
    torch.testing.assert_close(out1[1, :11], ref[1][:11], atol=TOL, rtol=0)
    torch.testing.assert_close(out2[0, :1], ref[0][30:], atol=TOL, rtol=0)
    torch.testing.assert_close(out2[1, :33], ref[1][11:], atol=TOL, rtol=0)
    torch.testing.assert_close(out2[2, :17], ref[2], atol=TOL, rtol=0)
    last = step(model.new_cache(num_slots=2, max_len=64), [(1, 0, seqs[0][:30]), (0, 0, seqs[1][:11])], last=True)
    torch.testing.assert_close(last, torch.stack([ref[0][29], ref[1][10]]), atol=TOL, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_gradients_on_packed_rows_match_transformers(arch, checkpoints, adapter):
    """The trainer's backward: a packed row's loss gives transformers' gradients (each
    sequence run alone there)."""
    hf, model = reference(checkpoints[arch]), build(adapter, checkpoints[arch]).train()
    hf.train()
    g = torch.Generator().manual_seed(1)
    a, b = (torch.randint(0, hf.config.vocab_size, (n,), generator=g) for n in (20, 13))
    row = torch.cat([a, b])[None]
    pos = torch.cat([torch.arange(20), torch.arange(13)])[None]
    seg = torch.cat([torch.zeros(20, dtype=torch.long), torch.ones(13, dtype=torch.long)])[None]
    model(row, pos, torch.tensor([33]), segment_ids=seg).logits.logsumexp(-1).sum().backward()
    sum(hf(input_ids=s[None]).logits.logsumexp(-1).sum() for s in (a, b)).backward()
    ours = dict(model.named_parameters())
    compared = 0
    for name, p in hf.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(ours[name].grad, p.grad, atol=1e-4, rtol=1e-4)
            compared += 1
    assert compared > 10


@pytest.mark.parametrize("arch", ARCHS)
def test_saved_checkpoint_is_transformers_layout_and_loads_back(arch, checkpoints, adapter, tmp_path):
    """save_checkpoint writes the names save_pretrained writes (mixtral's and minimax's
    per-expert w1/w3/w2 under block_sparse_moe, not the fused in-memory tensors);
    transformers loads it with the changed weights, and so does load_checkpoint."""
    from safetensors import safe_open

    model = build(adapter, checkpoints[arch])
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    adapter.save_checkpoint(model, tmp_path / "out", adapter.tokenizer(ModelConfig(checkpoint=str(checkpoints[arch]))))

    def names(d):
        with safe_open(str(d / "model.safetensors"), "pt") as f:
            return set(f.keys())

    assert names(tmp_path / "out") == names(checkpoints[arch])
    back = reference(tmp_path / "out")
    for name, t in back.state_dict().items():
        torch.testing.assert_close(t, model.state_dict()[name], atol=0, rtol=0)
    fresh = build(adapter, checkpoints[arch])
    adapter.load_checkpoint(fresh, tmp_path / "out")
    for name, t in fresh.state_dict().items():
        torch.testing.assert_close(t, model.state_dict()[name], atol=0, rtol=0)


def test_a_checkpoint_that_does_not_fit_is_refused_before_any_weight_changes(checkpoints, adapter):
    from primerl.weights import WeightsError

    model = build(adapter, checkpoints["llama"])
    before = {n: t.clone() for n, t in model.state_dict().items()}
    with pytest.raises(WeightsError, match="does not fit the model"):
        adapter.load_checkpoint(model, checkpoints["mixtral"])
    assert all(torch.equal(before[n], t) for n, t in model.state_dict().items())


def _served(arch, ckpt):
    """transformers' greedy 8 tokens and prompt logprobs against `primerl inference --model hf`."""
    import httpx

    hf = reference(ckpt)
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Reverse: the quick brown fox"}],
                                     add_generation_prompt=True, tokenize=False)
    ids = tok.encode(prompt)
    with torch.no_grad():
        greedy = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                             pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
        lp = hf(input_ids=torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
        prompt_lp = lp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
    with InferenceServer("--model", "hf", "--model.checkpoint", str(ckpt), "--inference.dtype", "float32",
                         "--inference.max_model_len", "256") as server:
        r = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": "hf", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == greedy
        r = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": "hf", "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0, "temperature": 0})
        assert r.status_code == 200, r.text
        got = r.json()["choices"][0]["logprobs"]["token_logprobs"]
        assert got[0] is None and got[1:] == pytest.approx(prompt_lp, abs=1e-4)


def test_served_greedy_tokens_and_prompt_logprobs_match_transformers(checkpoints):
    _served("llama", checkpoints["llama"])


@pytest.mark.slow
@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "llama"])
def test_served_greedy_tokens_and_prompt_logprobs_match_transformers_for_every_arch(arch, checkpoints):
    _served(arch, checkpoints[arch])


def _check(*args):
    return subprocess.run([sys.executable, "-m", "primerl.cli", "run", "--env", "reverse-text", "--dry-run", *args],
                          capture_output=True, text=True, timeout=120)


def test_what_the_hf_model_cannot_do_is_refused_at_config_time(checkpoints, tmp_path):
    """One line naming the key and the fix, before any process starts."""
    r = _check("--model", "hf")
    assert r.returncode == 2 and "--model.checkpoint DIR" in r.stderr and "Traceback" not in r.stderr, r.stderr
    ckpt = str(checkpoints["mixtral"])
    r = _check("--model", "hf", "--model.checkpoint", ckpt, "--trainer.router_replay")
    assert r.returncode == 2 and "trainer.router_replay" in r.stderr and "does not support router replay" in r.stderr
    r = _check("--model", "hf", "--model.checkpoint", ckpt, "--trainer.nproc", "2", "--trainer.parallel.ep", "2")
    assert r.returncode == 2 and "does not support expert parallel" in r.stderr
    hybrid = tmp_path / "hybrid"
    hybrid.mkdir()
    (hybrid / "config.json").write_text(json.dumps({"model_type": "qwen3_next",
                                                    "layer_types": ["linear_attention", "full_attention"]}))
    r = _check("--model", "hf", "--model.checkpoint", str(hybrid))
    assert r.returncode == 2 and "linear_attention" in r.stderr and "attention-only" in r.stderr, r.stderr
    encoder = tmp_path / "encoder"
    encoder.mkdir()
    (encoder / "config.json").write_text(json.dumps({"model_type": "t5"}))
    r = _check("--model", "hf", "--model.checkpoint", str(encoder))
    assert r.returncode == 2 and "'t5' is not a causal LM" in r.stderr, r.stderr
    assert _check("--model", "hf", "--model.checkpoint", ckpt).returncode == 0


def test_a_checkpoint_with_its_own_plugin_says_so(checkpoints, adapter, capfd):
    build(adapter, checkpoints["qwen3"])
    assert "primerl's own plugin --model qwen3" in capfd.readouterr().err
    build(adapter, checkpoints["mixtral"])  # no plugin implements mixtral (llama has its own plugin now)
    assert "own plugin" not in capfd.readouterr().err


MORE = {  # further architectures, config overrides on a tiny shape (mask and cache paths they add)
    "mistral": dict(sliding_window=8),  # every layer sliding
    "gemma2": dict(head_dim=16, sliding_window=8),  # eager attention with logit soft-capping, mixed layers
    "cohere": {},  # logit_scale in the head
    "glm4_moe": dict(n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, moe_intermediate_size=32,
                     head_dim=16),
    "deepseek_v3": dict(num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                        qk_nope_head_dim=8, v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2,
                        first_k_dense_replace=1, moe_intermediate_size=32, n_group=1, topk_group=1),  # keys != values
}


@pytest.mark.parametrize("arch", sorted(MORE))
def test_more_architectures_match_transformers_packed_and_cached(arch, adapter, tmp_path):
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=300, max_position_embeddings=512)
    config = transformers.AutoConfig.for_model(arch, **{**shape, **MORE[arch]})
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path)
    hf, model = reference(tmp_path), adapter.build(ModelConfig(name="hf", checkpoint=str(tmp_path))).eval()
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, 300, (31,), generator=g), torch.randint(0, 300, (20,), generator=g)
    with torch.no_grad():
        ref_a, ref_b = hf(input_ids=a[None]).logits[0], hf(input_ids=b[None]).logits[0]
        pos = torch.cat([torch.arange(31), torch.arange(20)])[None]
        seg = torch.cat([torch.zeros(31), torch.ones(20)]).long()[None]
        out = model(torch.cat([a, b])[None], pos, torch.tensor([51]), segment_ids=seg).logits[0]
        cache = model.new_cache(num_slots=2, max_len=64)
        first = model(a[None, :25], torch.arange(25)[None], torch.tensor([25]), cache=cache, slots=range(1, 2),
                      past_lens=torch.tensor([0])).logits[0]
        rest = model(a[None, 25:], torch.arange(25, 31)[None], torch.tensor([6]), cache=cache, slots=range(1, 2),
                     past_lens=torch.tensor([25])).logits[0]
    torch.testing.assert_close(out[:31], ref_a, atol=TOL, rtol=0)
    torch.testing.assert_close(out[31:], ref_b, atol=TOL, rtol=0)
    torch.testing.assert_close(torch.cat([first, rest]), ref_a, atol=TOL, rtol=0)
