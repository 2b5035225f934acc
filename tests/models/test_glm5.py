"""The GLM-5 plugin: our model against HF's GlmMoeDsaForCausalLM, and the RL-specific forward.

Everything runs on the tiny preset (about a million parameters) in float32 on the CPU.
index_topk is 32, so sequences longer than 32 tokens go through the DSA sparse path.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("primerl_glm5")

from primerl_glm5.adapter import Glm5

from primerl.models import ModelConfig
from primerl.tokenizer import EOS_TOKEN_ID, VOCAB_SIZE, byte_tokenizer

TOL = 1e-5


@pytest.fixture(scope="module")
def adapter():
    return Glm5()


@pytest.fixture(scope="module")
def model(adapter):
    return adapter.build(ModelConfig(preset="tiny", seed=0)).eval()


@pytest.fixture(scope="module")
def hf_model(adapter, model):
    config = transformers.GlmMoeDsaConfig(**adapter.hf_config("tiny"))
    hf = transformers.GlmMoeDsaForCausalLM._from_config(
        config, attn_implementation="eager", dtype=torch.float32
    )
    hf.load_state_dict(model.state_dict(), strict=True)
    return hf.eval()


def random_ids(*shape, seed=0):
    return torch.randint(0, VOCAB_SIZE, shape, generator=torch.Generator().manual_seed(seed))


def full_forward(model, ids):
    """Uncached forward of whole sequences: ids [B, S] -> logits [B, S, V]."""
    B, S = ids.shape
    with torch.no_grad():
        return model(ids, torch.arange(S).expand(B, S), torch.full((B,), S)).logits


# (a) ------------------------------------------------------------------------------------


@pytest.mark.parametrize("seq_len", [20, 90])  # below and above index_topk (32)
def test_logits_match_hf(model, hf_model, seq_len):
    ids = random_ids(2, seq_len, seed=seq_len)
    with torch.no_grad():
        ref = hf_model(ids).logits
    ours = full_forward(model, ids)
    assert ours.shape == (2, seq_len, model.config.vocab_size)
    torch.testing.assert_close(ours, ref, atol=TOL, rtol=0)


def test_sparse_attention_path_is_exercised(model):
    ids = random_ids(1, 90, seed=3)
    dense = copy.deepcopy(model)
    for layer in dense.model.layers:
        if layer.self_attn.indexer is not None:
            layer.self_attn.indexer.topk = 10**6
    sparse_logits, dense_logits = full_forward(model, ids), full_forward(dense, ids)
    assert torch.allclose(sparse_logits[:, :32], dense_logits[:, :32], atol=TOL)  # <= 32 keys: no selection
    assert (sparse_logits[:, 40:] - dense_logits[:, 40:]).abs().max() > 1e-3


def test_attention_traces_as_one_graph(model):
    """While torch.compile traces, MLA's folded weights are rebuilt in the graph, RoPE
    copies its pairs and the DSA indexer scores every query (no data-dependent shortcut):
    every layer's attention is one graph, with the eager outputs (90 tokens: the indexer
    selects)."""
    from primerl.models.batch import Batch

    x = torch.randn(2, 90, model.config.hidden_size, generator=torch.Generator().manual_seed(0))

    def attend(x):
        B, S, _ = x.shape
        i = torch.arange(S)
        batch = Batch(i.expand(B, S), torch.full((B,), S), torch.ones(B, S, dtype=torch.bool),
                      (i[None, :] <= i[:, None]).expand(B, S, S))
        model.prepare(batch, x.dtype)
        carry, outs = None, []
        for layer in model.model.layers:
            out, carry = layer.self_attn(x, batch, carry)
            outs.append(out)
        return torch.stack(outs)  # [layers, B, S, hidden]

    with torch.no_grad():
        ref = attend(x)
        traced = torch.compile(attend, backend="eager", fullgraph=True)(x)
    torch.testing.assert_close(traced, ref, atol=TOL, rtol=0)


def test_dsa_top_keys_break_exact_ties_like_a_stable_sort():
    """The indexer's top-k picks what a stable descending sort picks (earlier key first on
    exact ties, which relu makes common: all-zero scores), whatever the padding."""
    from primerl_glm5.model import top_keys

    gen = torch.Generator().manual_seed(0)
    for _ in range(100):
        T = int(torch.randint(33, 90, (1,), generator=gen))
        scores = torch.randint(0, 6, (3, 4, T), generator=gen).float()  # few values: many ties
        scores[torch.rand(3, 4, T, generator=gen) < 0.4] = float("-inf")  # keys not visible
        order = scores.sort(dim=-1, descending=True, stable=True).indices[..., :32]
        expected = torch.zeros(3, 4, T, dtype=torch.bool).scatter_(-1, order, True)
        assert torch.equal(top_keys(scores, 32), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partial_rotation_rotates_the_rope_pairs_and_leaves_the_others_bit_for_bit(dtype):
    """The DSA indexer (rope dims first) and MLA's cache rows (rope dims last) rotate a whole
    row in one op: the rope dims exactly as rotating them alone, every other dim unchanged."""
    from primerl_blocks.layers import partial_rotation, rope_angles, rope_interleaved, rope_rotation

    rope, other = 16, 24  # dims
    positions = torch.arange(7).expand(2, 7)
    cos, sin = rope_angles(positions, 1.0 / 10000 ** (torch.arange(0, rope, 2).float() / rope), 1.0, torch.float32)
    extra = {"rot": rope_rotation(cos, sin)}  # [B, S, rope/2]
    x = torch.randn(2, 7, rope + other, generator=torch.Generator().manual_seed(0)).to(dtype)

    first = rope_interleaved(x, partial_rotation(extra, after=other // 2))  # rope dims first
    assert torch.equal(first[..., :rope], rope_interleaved(x[..., :rope], extra["rot"]))
    assert torch.equal(first[..., rope:], x[..., rope:])
    last = rope_interleaved(x, partial_rotation(extra, before=other // 2))  # rope dims last
    assert torch.equal(last[..., other:], rope_interleaved(x[..., other:], extra["rot"]))
    assert torch.equal(last[..., :other], x[..., :other])
    assert first.dtype == last.dtype == dtype
    assert partial_rotation(extra, after=other // 2) is partial_rotation(extra, after=other // 2)  # built once


def test_model_shape_and_layout(adapter, model, hf_model):
    assert model.config.indexer_types == ("full", "shared", "full", "shared")
    assert adapter.moe_layout(ModelConfig(preset="tiny")) == {
        "moe_layers": [1, 2, 3],
        "num_experts": 8,
        "top_k": 2,
    }
    assert set(model.state_dict()) == set(hf_model.state_dict())
    full = adapter.moe_layout(ModelConfig(preset="full"))
    assert full["moe_layers"] == list(range(3, 78)) and full["num_experts"] == 256 and full["top_k"] == 8


# (b) ------------------------------------------------------------------------------------


def test_ragged_cached_decoding_matches_full_forward(model):
    seqs = [random_ids(1, n, seed=10 + n)[0] for n in (51, 40, 45)]
    forked = torch.cat([seqs[0][:50], random_ids(1, 1, seed=99)[0]])  # slot 3 reuses slot 0's prefix
    cache = model.new_cache(num_slots=4, max_len=64)

    def step(rows):
        """rows: (slot, past_len, new tokens). Returns logits [B, S, V] of one mixed batch."""
        S = max(len(toks) for _, _, toks in rows)
        ids = torch.zeros(len(rows), S, dtype=torch.long)
        positions = torch.zeros_like(ids)
        for b, (_, past, toks) in enumerate(rows):
            ids[b, : len(toks)] = toks
            positions[b, : len(toks)] = torch.arange(past, past + len(toks))
        with torch.no_grad():
            return model(
                ids,
                positions,
                torch.tensor([len(t) for _, _, t in rows]),
                cache=cache,
                slots=torch.tensor([s for s, _, _ in rows]),
                past_lens=torch.tensor([p for _, p, _ in rows]),
            ).logits

    # Step 1: two prefills of different lengths.
    out1 = step([(0, 0, seqs[0][:50]), (1, 0, seqs[1][:10])])
    # Step 2: a 1-token decode (past 50), a continued prefill (past 10), a fresh prefill,
    # and a decode on a slot whose 50-token prefix was copied from slot 0.
    cache.copy_prefix(0, 3, 50)
    out2 = step([(0, 50, seqs[0][50:]), (1, 10, seqs[1][10:]), (2, 0, seqs[2]), (3, 50, forked[50:])])

    ref = [full_forward(model, s[None])[0] for s in (*seqs, forked)]
    torch.testing.assert_close(out1[0, :50], ref[0][:50], atol=TOL, rtol=0)
    torch.testing.assert_close(out1[1, :10], ref[1][:10], atol=TOL, rtol=0)
    torch.testing.assert_close(out2[0, :1], ref[0][50:], atol=TOL, rtol=0)
    torch.testing.assert_close(out2[1, :30], ref[1][10:], atol=TOL, rtol=0)
    torch.testing.assert_close(out2[2, :45], ref[2], atol=TOL, rtol=0)
    torch.testing.assert_close(out2[3, :1], ref[3][50:], atol=TOL, rtol=0)


def test_last_logits_and_padding(model):
    ids = random_ids(2, 40, seed=5)
    lengths = torch.tensor([40, 25])
    positions = torch.arange(40).expand(2, 40)
    with torch.no_grad():
        last = model(ids, positions, lengths, logits_for="last").logits
        full = model(ids, positions, lengths).logits
    assert last.shape == (2, model.config.vocab_size)
    torch.testing.assert_close(last, full[torch.arange(2), lengths - 1], atol=TOL, rtol=0)
    # Padding never leaks into valid tokens: row 1 equals its unpadded forward.
    torch.testing.assert_close(full[1, :25], full_forward(model, ids[1:, :25])[0], atol=TOL, rtol=0)
    assert torch.isfinite(full).all()


# (c) ------------------------------------------------------------------------------------


def test_packed_segments_match_separate_forwards(model):
    rows = [[7, 40, 13], [33, 30]]
    S = 64
    ids = torch.zeros(2, S, dtype=torch.long)
    positions = torch.zeros_like(ids)
    segment_ids = torch.full_like(ids, -1)
    parts = []
    for b, lens in enumerate(rows):
        start = 0
        for seg, n in enumerate(lens):
            toks = random_ids(1, n, seed=100 * b + seg)[0]
            ids[b, start : start + n] = toks
            positions[b, start : start + n] = torch.arange(n)
            segment_ids[b, start : start + n] = seg
            parts.append((b, start, toks))
            start += n
    lengths = torch.tensor([sum(r) for r in rows])
    with torch.no_grad():
        packed = model(ids, positions, lengths, segment_ids=segment_ids)
    for b, start, toks in parts:
        with torch.no_grad():
            alone = model(toks[None], torch.arange(len(toks))[None], torch.tensor([len(toks)]))
        torch.testing.assert_close(
            packed.logits[b, start : start + len(toks)], alone.logits[0], atol=TOL, rtol=0
        )
        assert torch.equal(packed.routed_experts[b, start : start + len(toks)], alone.routed_experts[0])


# (d) ------------------------------------------------------------------------------------


def test_router_replay(model):
    ids = random_ids(2, 48, seed=7)
    positions = torch.arange(48).expand(2, 48)
    lengths = torch.tensor([48, 30])
    with torch.no_grad():
        first = model(ids, positions, lengths)
    routed = first.routed_experts
    n_moe, top_k = len(model.config.moe_layers), model.config.num_experts_per_tok
    assert routed.shape == (2, 48, n_moe, top_k)
    assert int(routed.min()) >= 0 and int(routed.max()) < model.config.n_routed_experts

    # Replaying the recorded choice reproduces the forward exactly (padding may hold garbage).
    replay = routed.clone()
    replay[1, 30:] = -1
    with torch.no_grad():
        again = model(ids, positions, lengths, replay_experts=replay)
    assert torch.equal(again.logits[0], first.logits[0]) and torch.equal(
        again.logits[1, :30], first.logits[1, :30]
    )
    assert torch.equal(again.routed_experts[:, :30], routed[:, :30])

    # Forcing other experts changes the outputs, and the router still gets gradients.
    trained = copy.deepcopy(model).train()
    forced = (routed.long() + 1) % model.config.n_routed_experts
    out = trained(ids, positions, lengths, replay_experts=forced)
    assert torch.equal(out.routed_experts[:, :30], forced[:, :30].to(out.routed_experts.dtype))
    assert (out.logits[0] - first.logits[0]).abs().max() > 1e-4
    out.logits[0].logsumexp(-1).mean().backward()
    for i in model.config.moe_layers:
        mlp = trained.model.layers[i].mlp
        assert mlp.gate.weight.grad is not None and mlp.gate.weight.grad.abs().sum() > 0
        assert mlp.experts.gate_up_proj.grad.abs().sum() > 0
    assert trained.model.layers[0].self_attn.kv_b_proj.weight.grad.abs().sum() > 0


# (e) ------------------------------------------------------------------------------------


def test_greedy_decoding_matches_hf_generate(model, hf_model):
    prompts = [random_ids(1, 12, seed=21)[0], random_ids(1, 5, seed=22)[0]]  # shorter than index_topk
    new_tokens = 40  # decoding runs past index_topk, into the sparse path
    expected = []
    for p in prompts:
        with torch.no_grad():
            out = hf_model.generate(
                p[None],
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                do_sample=False,
                max_new_tokens=new_tokens,
                eos_token_id=None,
                pad_token_id=EOS_TOKEN_ID,
            )
        expected.append(out[0, len(p) :].tolist())

    # Both prompts decode together in one batch: a ragged prefill, then 1-token steps.
    cache = model.new_cache(num_slots=2, max_len=64)
    lengths = torch.tensor([len(p) for p in prompts])
    ids = torch.zeros(2, int(lengths.max()), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = p
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    past = torch.zeros(2, dtype=torch.long)
    slots = torch.arange(2)
    generated = [[], []]
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(
                ids, positions, lengths, cache=cache, slots=slots, past_lens=past, logits_for="last"
            ).logits
            nxt = logits.argmax(-1)
            for b in range(2):
                generated[b].append(int(nxt[b]))
            past = past + lengths
            ids, positions, lengths = nxt[:, None], past[:, None], torch.ones(2, dtype=torch.long)
    assert generated == expected


# (f) ------------------------------------------------------------------------------------


def test_save_checkpoint_loads_in_hf(adapter, model, tmp_path):
    tok = adapter.tokenizer(ModelConfig(preset="tiny"))
    adapter.save_checkpoint(model, tmp_path, tokenizer=tok)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", dtype=torch.float32
    )
    ids = random_ids(2, 50, seed=31)
    with torch.no_grad():
        torch.testing.assert_close(hf.eval()(ids).logits, full_forward(model, ids), atol=TOL, rtol=0)

    # ... and back into our model, bit-exactly, with its tokenizer.
    config = ModelConfig(checkpoint=str(tmp_path))
    reloaded = adapter.build(config)
    for name, t in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], t), name
    assert adapter.tokenizer(config).encode("héllo") == tok.encode("héllo")
    assert json.loads((tmp_path / "config.json").read_text())["eos_token_id"] == EOS_TOKEN_ID


def test_sharded_hf_checkpoint_loads_bit_exactly(adapter, model, hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path / "hf", max_shard_size="200KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    ours = adapter.build(ModelConfig(checkpoint=str(tmp_path / "hf")))
    for name, t in hf_model.state_dict().items():
        assert torch.equal(ours.state_dict()[name], t), name

    # Our own sharded output loads in HF too.
    adapter.save_checkpoint(model, tmp_path / "ours", max_shard_bytes=300_000)
    assert len(list((tmp_path / "ours").glob("model-*-of-*.safetensors"))) > 1
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32)
    for name, t in model.state_dict().items():
        assert torch.equal(hf.state_dict()[name], t), name


def test_checkpoint_loading_is_strict(adapter, model, tmp_path):
    from safetensors.torch import load_file, save_file

    adapter.save_checkpoint(model, tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    mtp = {"model.layers.4.eh_proj.weight": torch.zeros(2, 2)}  # an MTP layer: skipped
    save_file({**weights, **mtp}, tmp_path / "model.safetensors")
    adapter.build(ModelConfig(checkpoint=str(tmp_path)))
    del weights["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="missing.*experts.gate_up_proj"):
        adapter.build(ModelConfig(checkpoint=str(tmp_path)))


def test_random_init_is_deterministic_and_casts(adapter, model):
    code = (
        "import hashlib, torch\n"
        "from primerl.models import ModelConfig\n"
        "from primerl_glm5.adapter import Glm5\n"
        "m = Glm5().build(ModelConfig(preset='tiny', seed=0))\n"
        "h = hashlib.sha256()\n"
        "for k, v in sorted(m.state_dict().items()): h.update(k.encode()); h.update(v.numpy().tobytes())\n"
        "print(h.hexdigest())\n"
    )
    import hashlib

    local = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        local.update(k.encode())
        local.update(v.numpy().tobytes())
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert other.stdout.strip() == local.hexdigest()

    reseeded = adapter.build(ModelConfig(preset="tiny", seed=1))
    assert not torch.equal(reseeded.lm_head.weight, model.lm_head.weight)
    sd = model.state_dict()
    assert torch.equal(sd["model.layers.1.input_layernorm.weight"], torch.ones(128))
    assert torch.equal(sd["model.layers.1.mlp.gate.e_score_correction_bias"], torch.zeros(8))
    assert abs(sd["model.embed_tokens.weight"].std().item() - 0.02) < 2e-3

    bf16 = adapter.build(ModelConfig(preset="tiny", seed=0, dtype="bfloat16"))
    assert bf16.model.embed_tokens.weight.dtype == torch.bfloat16
    assert bf16.model.layers[1].mlp.gate.weight.dtype == torch.float32  # routing stays float32
    assert torch.equal(bf16.lm_head.weight, model.lm_head.weight.to(torch.bfloat16))
    with torch.no_grad():
        out = bf16(random_ids(1, 40), torch.arange(40)[None], torch.tensor([40]))
    assert out.logits.dtype == torch.bfloat16 and torch.isfinite(out.logits.float()).all()


def test_plugin_entry_point_is_light():
    from importlib.metadata import entry_points

    assert any(
        ep.name == "glm5" and ep.value == "primerl_glm5.plugin" for ep in entry_points(group="primerl")
    )
    code = (
        "import sys\n"
        "import primerl_glm5.plugin, primerl_glm5.adapter\n"
        "from primerl.models import ModelConfig\n"
        "a = primerl_glm5.adapter.Glm5()\n"
        "a.hf_config('full'); a.moe_layout(ModelConfig())\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# (g) ------------------------------------------------------------------------------------


def test_byte_tokenizer(tmp_path, adapter):
    tok = byte_tokenizer()
    assert len(tok) == VOCAB_SIZE == 263 and adapter.hf_config("tiny")["vocab_size"] == 320
    assert tok.eos_token == tok.pad_token == "<|endoftext|>" and tok.eos_token_id == tok.pad_token_id == 256
    specials = ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]
    assert tok.convert_tokens_to_ids(specials) == list(range(257, 263))
    assert tok.encode("abc") == [97, 98, 99] and tok.encode("é") == list("é".encode())
    for text in [
        "Hello, world!",
        "  leading spaces\tand\ttabs\n\n",
        "héllo wörld ✓ 你好 🙂",
        "\x00\x7f\xff",
        "",
    ]:
        ids = tok.encode(text)
        assert ids == list(text.encode()) and tok.decode(ids) == text
    assert tok.encode("a<|user|>b") == [97, 260, 98]

    messages = [
        {"role": "system", "content": "Reverse the text."},
        {"role": "user", "content": "abc"},
        {"role": "assistant", "content": "cba"},
        {"role": "tool", "content": "ok"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "[gMASK]<sop><|system|>\nReverse the text.<|user|>\nabc<|assistant|>\ncba<|observation|>\nok<|assistant|>\n"
    )
    assert (
        tok.apply_chat_template(messages[:2], tokenize=False)
        == "[gMASK]<sop><|system|>\nReverse the text.<|user|>\nabc"
    )

    tok.save_pretrained(tmp_path)
    again = transformers.AutoTokenizer.from_pretrained(tmp_path)
    sample = "round trip ✓ <|assistant|>"
    assert again.encode(sample) == tok.encode(sample) and len(again) == len(tok)
    assert again.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == text
    assert byte_tokenizer().get_vocab() == tok.get_vocab()
