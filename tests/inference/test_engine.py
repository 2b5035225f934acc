"""The embedded engine against references: HF generate, a plain forward pass, live updates."""

import time

import pytest
import torch
from primerl_embedded.engine import Engine, RequestError, SamplingParams

from primerl.models import ModelConfig
from primerl.registry import get_registry


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    adapter = get_registry().load("model", "glm5")()
    cfg = ModelConfig(name="glm5", preset="tiny", seed=1)
    model = adapter.build(cfg)
    tok = adapter.tokenizer(cfg)
    return adapter, cfg, model, tok


def make_engine(model, tok, **kw):
    eng = Engine(model, eos_token_ids=[tok.eos_token_id], max_batch_size=kw.pop("max_batch_size", 16),
                 max_model_len=kw.pop("max_model_len", 256), kv_slots=kw.pop("kv_slots", 32), **kw)
    eng.decode = lambda ids: tok.decode(ids)
    return eng


def hf_model(adapter, cfg, model):
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_cfg = AutoConfig.for_model(**adapter.hf_config(cfg.preset))
    hf = AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager").eval()
    hf.load_state_dict(model.state_dict(), strict=False)
    return hf


PROMPTS = ["Reverse: hello", "apple", "a much longer prompt about quiet rivers", "xyz"]


@pytest.mark.parametrize("group_cost", [256, 0], ids=["one-prefill", "prefill-per-length"])
def test_greedy_batched_output_equals_hf_generate(setup, group_cost):
    adapter, cfg, model, tok = setup
    hf = hf_model(adapter, cfg, model)
    eng = make_engine(model, tok)
    eng.prefill_group_cost = group_cost  # 0: every prompt length is prefilled by its own forward
    seqs = [eng.submit(tok.encode(p), SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
            for p in PROMPTS]
    while eng.has_work():
        eng.step()
    for p, seq in zip(PROMPTS, seqs):
        ids = torch.tensor([tok.encode(p)])
        ref = hf.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert seq.output_ids == ref[0, ids.shape[1]:].tolist(), p


def test_prefill_groups_split_by_length_at_least_cost():
    """Rows sorted by length, cut into consecutive groups; the cut is the cheapest of all
    (checked by brute force), every row lands in exactly one group, in running order."""
    import itertools

    from primerl_embedded.engine import prefill_groups

    class Row:
        def __init__(self, n, cached=0):
            self.tokens, self.cached = [0] * n, cached

    def cost(groups, c):
        return sum(len(g) * max(len(r.tokens) - r.cached for r in g) + c for g in groups)

    rows = [Row(n) for n in (9, 60, 12, 33, 61, 10)] + [Row(40, cached=30)]  # 10 uncached tokens
    for c in (0, 20, 100, 10**6):
        groups = prefill_groups(rows, c)
        assert sorted(map(id, itertools.chain(*groups))) == sorted(map(id, rows))
        spans = [sorted(len(r.tokens) - r.cached for r in g) for g in groups]
        assert all(a[-1] <= b[0] for a, b in zip(spans, spans[1:]))  # consecutive in length order
        assert all([rows.index(r) for r in g] == sorted(rows.index(r) for r in g) for g in groups)  # running order
        order = sorted(rows, key=lambda r: len(r.tokens) - r.cached)
        brute = min(
            cost([order[a:b] for a, b in zip((0, *cuts), (*cuts, len(order)))], c)
            for k in range(len(order))
            for cuts in itertools.combinations(range(1, len(order)), k)
        )
        assert cost(groups, c) == brute
    assert len(prefill_groups(rows, 10**6)) == 1 and len(prefill_groups(rows, 0)) == 6  # 9, 10 (x2), 12, 33, 60, 61
    assert prefill_groups([], 0) == []


def test_logprobs_equal_a_plain_forward_pass(setup):
    _, _, model, tok = setup
    eng = make_engine(model, tok)
    prompt = tok.encode("the quick brown fox")
    (seq,) = eng.generate(prompt, SamplingParams(max_tokens=10, temperature=0.7, seed=3, ignore_eos=True))
    full = torch.tensor([prompt + seq.output_ids])
    n = full.shape[1]
    out = model(full, torch.arange(n)[None], torch.tensor([n]))
    logp = torch.log_softmax(out.logits[0].float() / 0.7, -1)
    ref = logp[len(prompt) - 1 : n - 1].gather(-1, torch.tensor(seq.output_ids)[:, None]).squeeze(-1)
    assert torch.allclose(torch.tensor(seq.logprobs), ref, atol=1e-5)


def test_seeded_sampling_is_reproducible_and_n_gives_distinct_samples(setup):
    _, _, model, tok = setup
    eng = make_engine(model, tok)
    p = SamplingParams(max_tokens=8, temperature=1.0, seed=7, n=4, ignore_eos=True)
    a = [s.output_ids for s in eng.generate(tok.encode("seed"), p)]
    b = [s.output_ids for s in eng.generate(tok.encode("seed"), p)]
    assert a == b
    assert len({tuple(x) for x in a}) > 1
    assert eng.stats.prefix_hit_tokens > 0  # siblings and the repeat reuse cached prompt KV


def test_groups_prefill_their_leaders_together_and_siblings_copy_the_prompt(setup):
    """Groups (n > 1) queued together: every leader's prompt runs in the first step (not one
    group per step behind the siblings waiting for their leader), every sibling then copies
    its leader's prompt instead of running it, and greedy outputs equal a group run alone."""
    _, _, model, tok = setup
    prompts = [tok.encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=5, temperature=0, n=3, ignore_eos=True)
    eng = make_engine(model, tok)
    groups = [eng.submit(p, params) for p in prompts]
    eng.step()
    leaders = [g[0] for g in groups]
    assert [s.cached for s in leaders] == [len(p) for p in prompts]  # all prompts ran in step 1
    assert all(s.slot < 0 for g in groups for s in g[1:]) and len(eng.waiting) == 2 * len(prompts)
    eng.step()
    assert not eng.waiting and eng.stats.prefix_hit_tokens == 2 * sum(len(p) - 1 for p in prompts)
    while eng.has_work():
        eng.step()
    for p, g in zip(prompts, groups):
        alone = make_engine(model, tok).generate(p, params)
        assert [s.output_ids for s in g] == [s.output_ids for s in alone]


def test_continuous_batching_matches_one_at_a_time(setup):
    _, _, model, tok = setup
    alone = []
    for p in PROMPTS:
        eng = make_engine(model, tok)
        alone.append(eng.generate(tok.encode(p), SamplingParams(max_tokens=6 + len(p) % 5, temperature=0))[0].output_ids)
    eng = make_engine(model, tok)
    seqs = []
    for p in PROMPTS:  # each request joins while earlier ones are mid-decode
        seqs.append(eng.submit(tok.encode(p), SamplingParams(max_tokens=6 + len(p) % 5, temperature=0))[0])
        eng.step()
        eng.step()
    while eng.has_work():
        eng.step()
    assert [s.output_ids for s in seqs] == alone


def test_slots_stay_compact_through_finishes_aborts_and_prefix_reuse(setup):
    """Running sequences always hold slots 0..n-1 (so forwards read the cache in place);
    finishing, aborting, sibling copies and idle prefixes moved or evicted in a cache too
    small to keep them all change no token and no routed expert."""
    _, _, model, tok = setup
    turns = [tok.encode(p) for p in PROMPTS + ["apple pie", "Reverse: hello world", "xyzzy"]]
    lengths = [3, 9, 5, 7, 4, 11, 6]

    def alone(prompt, n):
        eng = make_engine(model, tok)
        (s,) = eng.generate(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        return s.output_ids, s.routed_experts()

    eng = make_engine(model, tok, max_batch_size=4, kv_slots=5)
    kinds = []
    forward = eng.model.forward

    def spy(*args, **kw):
        kinds.append(type(kw["slots"]).__name__)
        return forward(*args, **kw)

    eng.model.forward = spy
    try:
        seqs, doomed = [], None
        for round_ in range(2):  # the second round finds the first round's prompts as idle prefixes
            for prompt, n in zip(turns, lengths):
                seqs.append((prompt, n, eng.submit(prompt, SamplingParams(max_tokens=n, temperature=0,
                                                                          ignore_eos=True))[0]))
            if round_ == 0:
                doomed = eng.submit(turns[0], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True, n=2))
            while eng.has_work():
                eng.step()
                if doomed and len(doomed[0].output_ids) == 5:
                    eng.abort(doomed)
                running = [s.slot for s in eng.running]
                assert running == list(range(len(running)))
                idle = set(eng.kv_store.slots())
                assert not idle & eng.free_slots and not idle & set(running)
                assert idle | eng.free_slots | set(running) == set(range(eng.kv_slots))
    finally:
        del eng.model.forward
    assert all(s.finish_reason == "abort" for s in doomed)
    assert eng.stats.prefix_hit_tokens > 0
    assert "range" in kinds  # compact batches were read in place
    for prompt, n, seq in seqs:
        ids, routed = alone(prompt, n)
        assert seq.output_ids == ids
        assert torch.equal(seq.routed_experts(), routed)


def test_weight_update_mid_generation_changes_version_and_breaks_nothing(setup):
    adapter, cfg, model, tok = setup
    import copy

    model = copy.deepcopy(model)
    eng = make_engine(model, tok)
    eng.start()
    try:
        seq = eng.submit(tok.encode("long rollout"), SamplingParams(max_tokens=200, temperature=1.0, seed=0,
                                                                    ignore_eos=True))[0]
        while len(seq.output_ids) < 20:
            time.sleep(0.001)
        new_model = adapter.build(ModelConfig(name="glm5", preset="tiny", seed=99))
        new = new_model.state_dict()
        version = eng.update_weights(lambda: model.load_state_dict(new))
        while seq.finish_reason is None:
            time.sleep(0.01)
        after = eng.submit(tok.encode("after"), SamplingParams(max_tokens=8, temperature=0))[0]
        while after.finish_reason is None:
            time.sleep(0.01)
    finally:
        eng.stop()
    assert version == 1 and seq.finish_reason == "length" and len(seq.output_ids) == 200
    assert seq.versions[0] == 0 and seq.versions[-1] == 1
    assert seq.versions == sorted(seq.versions)  # one switch, never back
    assert torch.equal(next(iter(model.state_dict().values())), next(iter(new.values())))
    # nothing derived from the old weights (stacked projections kept between decode steps) survives
    fresh = make_engine(new_model, tok).generate(tok.encode("after"), SamplingParams(max_tokens=8, temperature=0))[0]
    assert after.output_ids == fresh.output_ids and after.logprobs == pytest.approx(fresh.logprobs, abs=1e-5)


def test_bad_requests_are_rejected(setup):
    _, _, model, tok = setup
    eng = make_engine(model, tok, max_model_len=64)
    with pytest.raises(RequestError, match="exceeds the maximum model length"):
        eng.submit(list(range(60)), SamplingParams(max_tokens=10))
    with pytest.raises(RequestError, match="empty"):
        eng.submit([], SamplingParams())
    with pytest.raises(RequestError, match="token ids"):
        eng.submit([10**9], SamplingParams())


def test_abort_frees_the_slot_and_leaves_others_running(setup):
    _, _, model, tok = setup
    eng = make_engine(model, tok, kv_slots=16)
    keep = eng.submit(tok.encode("keep"), SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    gone = eng.submit(tok.encode("gone"), SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, n=3))
    for _ in range(3):
        eng.step()
    free_before = len(eng.free_slots)
    eng.abort(gone)
    while eng.has_work():
        eng.step()
    assert all(s.finish_reason == "abort" for s in gone)
    assert keep.finish_reason == "length" and len(keep.output_ids) == 20
    assert len(eng.free_slots) >= free_before + 3 - 1  # aborted slots are free (keep's is cached)


def test_shm_channel_adopts_mapped_weights_and_rejects_bad_files(setup, tmp_path):
    """The co-located channel: validate first, then swap in the mapped tensors."""
    import copy

    from primerl.weights import WeightsError, adopt, stage, write_safetensors

    adapter, _, model, tok = setup
    model = copy.deepcopy(model)
    new = adapter.build(ModelConfig(name="glm5", preset="tiny", seed=42)).state_dict()
    path = tmp_path / "w.safetensors"
    write_safetensors(new, path)
    bad = tmp_path / "bad.safetensors"
    write_safetensors({k: v for k, v in list(new.items())[1:]}, bad)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(WeightsError, match="missing tensor"):
        stage(model, bad, writable=True)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())  # untouched
    pairs = stage(model, path, writable=True)
    old = sorted(dst.data_ptr() for dst, _ in pairs)
    done = adopt(pairs)
    assert done.copied == 0  # same dtype on CPU: every tensor adopted, nothing copied
    # no copy: each parameter's storage is the mapped file's, and what it held before is handed back
    assert all(dst.data_ptr() == src.data_ptr() for dst, src in pairs)
    assert sorted(t.data_ptr() for t in done.replaced) == old
    del pairs, done
    assert all(torch.equal(model.state_dict()[k], v) for k, v in new.items())
    # adopted tensors are copy-on-write: a later in-place update leaves the file intact
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    from primerl.weights import iter_safetensors

    first_name = next(iter(model.state_dict()))
    assert torch.equal(dict(iter_safetensors(path))[first_name], new[first_name])
    eng = make_engine(model, tok)
    assert len(eng.generate(tok.encode("hi"), SamplingParams(max_tokens=4, temperature=0))[0].output_ids) == 4
    # adopted inside a running engine (its thread) the weights stay ordinary tensors and are used
    newer = adapter.build(ModelConfig(name="glm5", preset="tiny", seed=43))
    write_safetensors(newer.state_dict(), tmp_path / "w2.safetensors")
    eng.start()
    try:
        eng.update_weights(lambda: adopt(stage(model, tmp_path / "w2.safetensors", writable=True)))
        out = eng.submit(tok.encode("hi"), SamplingParams(max_tokens=6, temperature=0))[0]
        while out.finish_reason is None:
            time.sleep(0.01)
    finally:
        eng.stop()
    assert not any(p.is_inference() for p in model.parameters())
    ref = make_engine(newer, tok).generate(tok.encode("hi"), SamplingParams(max_tokens=6, temperature=0))[0]
    assert out.output_ids == ref.output_ids


def test_what_a_weight_update_returns_is_let_go_in_the_calling_thread(setup):
    """An adoption returns the weights it replaced; freeing them (unmapping the previous file)
    happens in the thread that asked for the update, after the engine has resumed, not in
    the engine's step gap."""
    import threading

    _, _, model, tok = setup
    freed_in: list[str] = []

    class Replaced:
        def __del__(self) -> None:
            freed_in.append(threading.current_thread().name)

    eng = make_engine(model, tok)
    eng.start()
    try:
        eng.submit(tok.encode("hi"), SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
        caller = threading.Thread(target=lambda: eng.update_weights(Replaced), name="caller")
        caller.start()
        caller.join()
        assert freed_in == ["caller"]
        assert eng.version == 1
    finally:
        eng.stop()


def test_priority_orders_the_queue_and_equal_priorities_keep_arrival_order(setup):
    _, _, model, tok = setup
    eng = make_engine(model, tok)  # not started: submissions stay queued
    names = {}
    for name, priority in [("a", 0), ("b", 0), ("c", -1), ("d", 5), ("e", -1), ("f", 0)]:
        for s in eng.submit([1, 2, 3], SamplingParams(max_tokens=1, n=2 if name == "c" else 1, priority=priority)):
            names[s.id] = name
    assert [names[s.id] for s in eng.waiting] == ["c", "c", "e", "a", "b", "f", "d"]


def test_a_cache_salt_keys_the_prefix_apart_from_every_other_salt():
    from primerl_embedded.engine import salted_key

    tokens = [5, 6, 7]
    assert salted_key(tokens, None) == tokens
    a, b = salted_key(tokens, "a"), salted_key(tokens, "b")
    assert a[1:] == b[1:] == tokens[1:] and len({a[0], b[0], tokens[0]}) == 3
    assert 2**31 <= a[0] < 2**32 and salted_key(tokens, "a") == a  # fits a block store's uint32, and is stable
    assert salted_key([6, 6], "a")[0] != a[0]  # distinct first tokens stay distinct under one salt
