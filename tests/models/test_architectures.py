"""Every model plugin against transformers, and the RL forward every model must provide.

Each test runs for each architecture's ``tiny`` preset in float32 on the CPU: GLM-5
(``glm_moe_dsa``, deeper tests in test_glm5.py), Kimi K2 (``deepseek_v3`` with YaRN),
Qwen3-MoE (``qwen3_moe``), Nemotron 3 (``nemotron_h``: Mamba-2 + attention + MoE) and the
dense Qwen3 (``qwen3``), MiniMax-M2 (``minimax_m2``: partial RoPE, per-layer q/k norm,
sigmoid-routed experts) and Llama (``llama``: Llama 3's RoPE frequency scaling).
"""

from __future__ import annotations

import copy
import json

import pytest
from conftest import InferenceServer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from primerl.models import ModelConfig
from primerl.registry import get_registry
from primerl.tokenizer import VOCAB_SIZE, byte_tokenizer

ARCHS = ["glm5", "kimi", "qwen3-moe", "nemotron", "qwen3", "minimax", "llama"]
TOL = 1e-5


@pytest.fixture(scope="module", params=ARCHS)
def arch(request):
    name = request.param
    adapter = get_registry().load("model", name)()
    model = adapter.build(ModelConfig(name=name, preset="tiny", seed=0)).eval()
    return name, adapter, model


def hf_twin(adapter, model, preset="tiny"):
    """transformers' own model class for the preset, holding our weights."""
    config = transformers.AutoConfig.for_model(**adapter.hf_config(preset))
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    hf.load_state_dict(model.state_dict(), strict=True)
    return hf.eval()


def random_ids(*shape, seed=0):
    return torch.randint(0, VOCAB_SIZE, shape, generator=torch.Generator().manual_seed(seed))


def packed_rows(rows, seed):
    """Random sequences of the lengths in ``rows`` (one list per row), packed as the trainer
    packs them, rows right-padded: (the sequences per row, ids, positions, segment_ids
    [B, S], lengths [B]). Sequence j of row r is seeded ``seed[0] + seed[1] * r + len``."""
    S = max(sum(lens) for lens in rows)
    parts = [[random_ids(1, n, seed=seed[0] + seed[1] * r + n)[0] for n in lens] for r, lens in enumerate(rows)]
    ids = torch.zeros(len(rows), S, dtype=torch.long)
    positions, segments = torch.zeros_like(ids), torch.zeros_like(ids)
    for r, lens in enumerate(rows):
        n = sum(lens)
        ids[r, :n] = torch.cat(parts[r])
        positions[r, :n] = torch.cat([torch.arange(k) for k in lens])
        segments[r, :n] = torch.cat([torch.full((k,), i) for i, k in enumerate(lens)])
    return parts, ids, positions, segments, torch.tensor([sum(lens) for lens in rows])


def forward(model, ids, lengths=None, **kw):
    B, S = ids.shape
    lengths = torch.full((B,), S) if lengths is None else lengths
    with torch.no_grad():
        return model(ids, torch.arange(S).expand(B, S), lengths, **kw)


def test_logits_match_transformers(arch):
    name, adapter, model = arch
    hf = hf_twin(adapter, model)
    ids = random_ids(2, 40, seed=1)
    with torch.no_grad():
        ref = hf(ids).logits
    torch.testing.assert_close(forward(model, ids).logits, ref, atol=TOL, rtol=0)
    # right padding never leaks into the valid tokens of a row
    out = forward(model, ids, torch.tensor([40, 23])).logits
    torch.testing.assert_close(out[1, :23], forward(model, ids[1:, :23]).logits[0], atol=TOL, rtol=0)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", ARCHS)
def test_small_preset_is_tens_of_millions_of_parameters_and_matches_transformers(name):
    """``small`` (bench/utilisation.py's preset): the same architecture at hidden 512-1024."""
    adapter = get_registry().load("model", name)()
    model = adapter.build(ModelConfig(name=name, preset="small", seed=0)).eval()
    assert 512 <= adapter.hf_config("small")["hidden_size"] <= 1024
    assert 10e6 <= sum(p.numel() for p in model.parameters()) <= 100e6
    ids = random_ids(2, 40, seed=1)
    with torch.no_grad():
        ref = hf_twin(adapter, model, "small")(ids).logits
    torch.testing.assert_close(forward(model, ids).logits, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("unpack", [True, False], ids=["one-sequence-per-row", "masked-rows"])
def test_packed_rows_match_separate_forwards(arch, unpack, monkeypatch):
    """Two packed rows (the second right-padded); attention either runs one sequence per
    row (the trainer's layout) or on the masked packed rows: both equal separate forwards."""
    from primerl.models.batch import make_batch

    _, _, model = arch
    monkeypatch.setattr(model, "unpack_segments", unpack)
    rows = [[4, 40, 14, 20], [5, 36]]  # GLM-5's DSA scores the queries past its 32 keys, in some sequences only
    parts, ids, positions, segments, lengths = packed_rows(rows, seed=(10, 7))
    layout = make_batch(positions, lengths, segments, None, None, None, unpack_segments=unpack)
    assert (layout.segments is not None) == unpack and (layout.visible is None) == unpack
    with torch.no_grad():
        packed = model(ids, positions, lengths, segment_ids=segments)
    for r, row_parts in enumerate(parts):
        start = 0
        for toks in row_parts:
            alone = forward(model, toks[None])
            n = len(toks)
            torch.testing.assert_close(packed.logits[r, start : start + n], alone.logits[0], atol=TOL, rtol=0)
            assert torch.equal(packed.routed_experts[r, start : start + n], alone.routed_experts[0])
            start += n


@pytest.mark.parametrize("rows", [[[4, 40, 14, 20], [5, 36]], [[30, 28], [29]]],
                         ids=["attention-per-sequence", "whole-forward-per-sequence"])
def test_training_gradients_on_packed_rows_match_transformers(arch, rows):
    """What the trainer differentiates: packed rows (one sequence per row in the attention
    only, or for the whole forward when that adds no positions), grad enabled, so the
    training-only paths run (MLA's folded projections, the RMSNorm backward, grouped expert
    GEMMs). The gradient of every weight equals transformers' on the sequences one by one."""
    name, adapter, model = arch
    hf = hf_twin(adapter, model)
    parts, ids, positions, segments, lengths = packed_rows(rows, seed=(3, 5))

    def loss_of(logits, toks):  # next-token cross-entropy of one sequence, summed
        return torch.nn.functional.cross_entropy(logits[:-1], toks[1:], reduction="sum")

    model.zero_grad()
    logits = model(ids, positions, lengths, segment_ids=segments).logits  # [B, S, V]
    total = 0
    for r, row_parts in enumerate(parts):
        start = 0
        for toks in row_parts:
            total = total + loss_of(logits[r, start : start + len(toks)], toks)
            start += len(toks)
    total.backward()
    hf.zero_grad()
    sum(loss_of(hf(toks[None]).logits[0], toks) for row_parts in parts for toks in row_parts).backward()
    ours = dict(model.named_parameters())
    # transformers' embedding has padding_idx = pad_token_id (the EOS token here) and never
    # trains that row; ours does, since EOS ends every completion it learns to sample
    pad = hf.get_input_embeddings().padding_idx
    compared = 0
    for pname, p in hf.named_parameters():
        if p.grad is None:
            continue
        assert ours[pname].grad is not None, pname
        mine, theirs = ours[pname].grad, p.grad
        if p is hf.get_input_embeddings().weight and pad is not None:
            keep = torch.arange(len(theirs)) != pad
            mine, theirs = mine[keep], theirs[keep]
        scale = theirs.abs().max().item()
        torch.testing.assert_close(mine, theirs, atol=1e-5 * max(scale, 1.0), rtol=1e-4, msg=lambda m, name=pname: f"{name}: {m}")
        compared += 1
    assert compared > 10
    model.zero_grad()


def test_ragged_cached_steps_match_full_forward(arch):
    """One call mixes a decode row, a continued prefill and a fresh prefill, as the engine does
    (rows 0 and 1 cross 32 tokens, where GLM-5's DSA starts to select keys)."""
    _, _, model = arch
    seqs = [random_ids(1, n, seed=20 + n)[0] for n in (31, 44, 17)]
    cache = model.new_cache(num_slots=3, max_len=48)

    def step(rows):
        S = max(len(t) for _, _, t in rows)
        ids = torch.zeros(len(rows), S, dtype=torch.long)
        pos = torch.zeros_like(ids)
        for b, (_, past, toks) in enumerate(rows):
            ids[b, : len(toks)] = toks
            pos[b, : len(toks)] = torch.arange(past, past + len(toks))
        with torch.no_grad():
            return model(ids, pos, torch.tensor([len(t) for _, _, t in rows]), cache=cache,
                         slots=torch.tensor([s for s, _, _ in rows]),
                         past_lens=torch.tensor([p for _, p, _ in rows])).logits

    out1 = step([(0, 0, seqs[0][:30]), (1, 0, seqs[1][:11])])
    out2 = step([(0, 30, seqs[0][30:]), (1, 11, seqs[1][11:]), (2, 0, seqs[2])])
    ref = [forward(model, s[None]).logits[0] for s in seqs]
    torch.testing.assert_close(out1[0, :30], ref[0][:30], atol=TOL, rtol=0)
    torch.testing.assert_close(out1[1, :11], ref[1][:11], atol=TOL, rtol=0)
    torch.testing.assert_close(out2[0, :1], ref[0][30:], atol=TOL, rtol=0)
    torch.testing.assert_close(out2[1, :33], ref[1][11:], atol=TOL, rtol=0)
    torch.testing.assert_close(out2[2, :17], ref[2], atol=TOL, rtol=0)


def test_router_replay_reproduces_routing_and_keeps_router_gradients(arch):
    name, adapter, model = arch
    if not model.moe_layers:
        # a dense model routes nothing: its routed experts are empty, and the config check refuses replay
        assert forward(model, random_ids(1, 5)).routed_experts.shape == (1, 5, 0, 0)
        assert not adapter.capabilities(ModelConfig(name=name)).router_replay
        return
    ids, lengths = random_ids(2, 24, seed=3), torch.tensor([24, 15])
    first = forward(model, ids, lengths)
    routed = first.routed_experts  # [B, S, L, k]
    assert routed.shape == (2, 24, len(model.moe_layers), model.config.num_experts_per_tok)
    assert torch.equal(first.router_experts, routed)  # no replay: used == the routers' own choice

    replay = routed.clone()
    replay[1, 15:] = -1  # padding may hold anything
    again = forward(model, ids, lengths, replay_experts=replay)
    assert torch.equal(again.logits[0], first.logits[0]) and torch.equal(again.logits[1, :15], first.logits[1, :15])
    assert torch.equal(again.routed_experts[:, :15], routed[:, :15])

    trained = copy.deepcopy(model).train()
    E = adapter.moe_layout(ModelConfig(name=name, preset="tiny"))["num_experts"]
    forced = (routed.long() + 1) % E
    out = trained(ids, torch.arange(24).expand(2, 24), lengths, replay_experts=forced)
    assert torch.equal(out.routed_experts[:, :15], forced[:, :15].to(torch.int16))
    # the first MoE layer's own choice is unchanged by forcing (its input is the same)
    assert torch.equal(out.router_experts[:, :15, 0], routed[:, :15, 0])
    out.logits[0].logsumexp(-1).mean().backward()
    routers = [m for n, m in trained.named_modules() if n.endswith((".gate", "mixer.gate")) and hasattr(m, "weight")]
    assert routers and all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in routers)


def test_parallel_plan_describes_layers_units_and_moe_modules(arch):
    name, adapter, model = arch
    from primerl.models.contract import check_causal_lm
    from primerl.models.experts import Experts

    plan = model.parallel_plan()
    n = len(model.model.layers)
    assert len(plan.fsdp_units) == n + 2 and plan.fsdp_units[0] == "model.layers.0"
    assert plan.fsdp_units[-2:] == (plan.embeddings, "lm_head") and plan.head == "lm_head"
    assert list(plan.moe_layers) == model.moe_layers
    assert len(plan.routers) == len(plan.experts) == len(model.moe_layers)
    mixers = {layer.mixer.value for layer in plan.layers}
    want = {"glm5": {"mla_dsa"}, "kimi": {"mla"}, "qwen3-moe": {"gqa"}, "nemotron": {"mamba2", "gqa", "none"},
            "qwen3": {"gqa"}, "minimax": {"gqa"}, "llama": {"gqa"}}[name]
    assert mixers == want
    # the routers, experts and correction biases the plan declares are the model's own
    modules, buffers = dict(model.named_modules()), dict(model.named_buffers())
    assert all(isinstance(modules[e], Experts) for e in plan.experts)
    assert all(modules[r].weight.shape[0] == modules[e].down_proj.shape[0] for r, e in zip(plan.routers, plan.experts))
    biased = {"glm5", "kimi", "nemotron", "minimax"}  # sigmoid routing ("noaux_tc"); qwen3-moe: softmax, no bias
    assert len(plan.router_biases) == (len(model.moe_layers) if name in biased else 0)
    assert all(buffers[b].shape == (modules[e].down_proj.shape[0],) for b, e in zip(plan.router_biases, plan.experts))
    assert plan.tied_embeddings == model.config.tie_word_embeddings
    assert check_causal_lm(model) == []


def test_checkpoint_round_trip_is_bit_exact_and_matches_transformers_names(arch, tmp_path):
    name, adapter, model = arch
    adapter.save_checkpoint(model, tmp_path / "ours", max_shard_bytes=400_000)
    assert len(list((tmp_path / "ours").glob("model-*-of-*.safetensors"))) > 1
    back = adapter.build(ModelConfig(name=name, checkpoint=str(tmp_path / "ours")))
    for key, t in model.state_dict().items():
        assert torch.equal(back.state_dict()[key], t), key
    # the published names are the ones transformers' save_pretrained writes
    hf_twin(adapter, model).save_pretrained(tmp_path / "hf")
    from safetensors import safe_open

    def names(d):
        out = set()
        for f in d.glob("*.safetensors"):
            with safe_open(str(f), "pt") as h:
                out |= set(h.keys())
        return out

    assert names(tmp_path / "ours") == names(tmp_path / "hf")


@pytest.mark.slow
def test_transformers_sharded_checkpoint_served_greedy_equals_generate(arch, tmp_path):
    """`primerl inference --checkpoint DIR` on a checkpoint written by transformers'
    save_pretrained (sharded) produces transformers' greedy tokens."""
    import httpx

    name, adapter, model = arch
    hf = hf_twin(adapter, model)
    # fresh, different weights so the test does not depend on our init
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() > 1:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel() % 97)) * 0.01)
    ckpt = tmp_path / "hf"
    hf.save_pretrained(ckpt, max_shard_size="300KB")
    byte_tokenizer().save_pretrained(str(ckpt))
    assert (ckpt / "model.safetensors.index.json").exists()
    prompt_ids = byte_tokenizer().encode("Reverse: rivers")
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt_ids):].tolist()

    with InferenceServer("--model", name, "--checkpoint", str(ckpt), "--inference.max_model_len", "128") as server:
        r = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": name, "prompt": prompt_ids, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
        })
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == ref


def test_engine_and_trainer_logprobs_agree(arch):
    """The engine's sampled-token logprobs equal the trainer's forward over the same tokens
    (float32 both sides), and the engine's recorded experts replay to the same routing."""
    from primerl_embedded.engine import Engine, SamplingParams

    from primerl.sampling import token_logprobs

    _, _, model = arch
    tok = byte_tokenizer()
    engine = Engine(model, eos_token_ids=[tok.eos_token_id], max_batch_size=4, max_model_len=96, kv_slots=4,
                    num_experts=64)
    prompt = tok.encode("Reverse: apple")
    seqs = engine.generate(prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=5, n=2, ignore_eos=True,
                                                  logprobs=0, return_routed_experts=True))
    for seq in seqs:
        full = torch.tensor([seq.tokens])
        n = full.shape[1]
        replay = seq.routed_experts()[: n][None].long()  # [1, tokens processed, L, k]
        pad = n - replay.shape[1]  # the last sampled token was never fed back
        replay = torch.cat([replay, replay[:, -1:].expand(1, pad, -1, -1)], 1) if pad else replay
        with torch.no_grad():
            out = model(full, torch.arange(n)[None], torch.tensor([n]), replay_experts=replay)
        lp = token_logprobs(out.logits[:, len(prompt) - 1 : n - 1], full[:, len(prompt):],
                            torch.ones(1, n - len(prompt)))[0]
        torch.testing.assert_close(lp, torch.tensor(seq.logprobs), atol=1e-4, rtol=0)
        agree = (out.router_experts[0, : n - pad].sort(-1).values == out.routed_experts[0, : n - pad].sort(-1).values)
        assert agree.all().item()  # fp32 on both sides: the trainer's routers agree (a dense model has none)


def test_block_fp8_quantisation_round_trips_and_fp8_checkpoints_load(tmp_path):
    """DeepSeek/Kimi block-FP8 format: weight float8_e4m3fn + weight_scale_inv per 128x128
    block; a checkpoint in that format loads dequantised (and is written back plain)."""
    from safetensors.torch import load_file, save_file

    from primerl.models.fp8 import FP8, dequantize_blockwise, quantize_blockwise

    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(0))
    q, s = quantize_blockwise(w)
    assert q.dtype == FP8 and s.shape == (3, 2)
    deq = dequantize_blockwise(q, s)
    assert (deq - w).abs().max() <= w.abs().max() * 2**-3  # e4m3: 3 mantissa bits
    q2, s2 = quantize_blockwise(deq)  # already on the FP8 grid: exact
    assert torch.equal(dequantize_blockwise(q2, s2), deq)
    with pytest.raises(ValueError, match="weight_scale_inv shape"):
        dequantize_blockwise(q, s[:, :1])

    adapter = get_registry().load("model", "kimi")()
    model = adapter.build(ModelConfig(name="kimi", preset="tiny", seed=1))
    plain = tmp_path / "plain"
    adapter.save_checkpoint(model, plain)
    tensors = load_file(str(plain / "model.safetensors"))
    fp8, deq = {}, {}  # the FP8 checkpoint, and what it means in float32
    for key, t in tensors.items():
        if key.endswith("proj.weight") and t.dim() == 2 and ".mlp.gate." not in key:
            fp8[key], fp8[key + "_scale_inv"] = quantize_blockwise(t)
            deq[key] = dequantize_blockwise(fp8[key], fp8[key + "_scale_inv"])
        else:
            fp8[key] = deq[key] = t
    cfg = json.loads((plain / "config.json").read_text())
    for name, content, quant in (("fp8", fp8, True), ("deq", deq, False)):
        (tmp_path / name).mkdir()
        save_file(content, str(tmp_path / name / "model.safetensors"))
        q = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                     "activation_scheme": "dynamic"}} if quant else {}
        (tmp_path / name / "config.json").write_text(json.dumps({**cfg, **q}))
    loaded = adapter.build(ModelConfig(name="kimi", checkpoint=str(tmp_path / "fp8")))
    ref = adapter.build(ModelConfig(name="kimi", checkpoint=str(tmp_path / "deq")))
    for key, t in ref.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], t), key
    assert not torch.equal(ref.state_dict()["model.layers.0.self_attn.o_proj.weight"],
                           model.state_dict()["model.layers.0.self_attn.o_proj.weight"])  # really rounded
    adapter.save_checkpoint(loaded, tmp_path / "back")
    assert "quantization_config" not in json.loads((tmp_path / "back" / "config.json").read_text())


@pytest.mark.parametrize("tokens", [40, 600])
def test_dense_and_sparse_experts_agree(tokens):
    """Small batches run every expert densely, large ones loop over the chosen experts: same
    outputs and same gradients, padding tokens untouched."""
    from primerl.models import experts as experts_module

    torch.manual_seed(0)
    experts = experts_module.Experts(8, 32, 16)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(tokens, 32, requires_grad=True)
    ids = torch.stack([torch.randperm(8)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2)
    valid = torch.rand(tokens) > 0.1
    outs, grads = [], []
    for path in ("dense", "sparse"):
        x.grad = None
        experts.zero_grad()
        y = experts._dense(x, ids, weights, valid) if path == "dense" else _sparse(experts, x, ids, weights, valid)
        y.square().sum().backward()
        outs.append(y.detach())
        grads.append([x.grad.clone(), *(p.grad.clone() for p in experts.parameters())])
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    assert torch.all(outs[1][~valid] == 0)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def _sparse(experts, x, ids, weights, valid):
    from primerl.models import experts as experts_module

    saved = experts_module.DENSE_EXPERTS_MAX_RATIO
    experts_module.DENSE_EXPERTS_MAX_RATIO = 0  # force the per-expert loop
    try:
        return experts(x, ids, weights, valid)
    finally:
        experts_module.DENSE_EXPERTS_MAX_RATIO = saved


def test_dense_experts_see_weight_updates_without_autograd():
    """Decode keeps the stacked down projections between steps; a weight update (in place,
    as the engine's channels write, or a new storage) must still be seen by the next step."""
    from primerl.models import experts as experts_module

    torch.manual_seed(0)
    experts = experts_module.Experts(8, 32, 16)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x, ids, weights, valid = torch.randn(5, 32), torch.randint(0, 8, (5, 2)), torch.rand(5, 2), torch.ones(5, dtype=torch.bool)

    def fresh():
        with torch.enable_grad():
            return experts._dense(x, ids, weights, valid).detach()

    with torch.inference_mode():
        before = experts._dense(x, ids, weights, valid)
        with torch.no_grad():
            experts.down_proj.mul_(2.0)  # in place
        assert torch.allclose(experts._dense(x, ids, weights, valid), 2 * before, atol=1e-6)
    experts.down_proj.data = torch.randn_like(experts.down_proj)  # new storage
    with torch.no_grad():
        torch.testing.assert_close(experts._dense(x, ids, weights, valid), fresh())


def test_slot_cache_swap_exchanges_prefixes_and_recurrent_states():
    """``SlotCache.swap(a, b, n)``: the first n positions of every per-token tensor and the
    whole recurrent state trade places; positions from n on and other slots stay put."""
    from primerl.models.batch import SlotCache

    layout = [{"per_token": {"ckv": (6,)}, "state": {"ssm": ((2, 3), torch.float32)}}, {"per_token": {"k": (4,)}}]
    cache = SlotCache(layout, num_slots=4, max_len=8, dtype=torch.float32, device="cpu")
    torch.manual_seed(0)
    for t in cache.tensors():
        t.copy_(torch.randn_like(t))
    before = [t.clone() for t in cache.tensors()]
    cache.swap(1, 3, n=5)
    cache.swap(2, 2)  # a slot with itself: nothing moves
    for old, new in zip(before, cache.tensors()):
        if new.dim() == 3 and new.shape[1] == 8:  # per token [slots, max_len, D]
            assert torch.equal(new[1, :5], old[3, :5]) and torch.equal(new[3, :5], old[1, :5])
            assert torch.equal(new[:, 5:], old[:, 5:])
        else:  # recurrent state [slots, ...]
            assert torch.equal(new[1], old[3]) and torch.equal(new[3], old[1])
        assert torch.equal(new[[0, 2]], old[[0, 2]])
