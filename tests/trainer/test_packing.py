"""Packing is lossless and keeps packed samples apart."""

import random

import attrs
import pytest
import torch

from primerl.models import ModelConfig
from primerl.samples import Sample
from primerl.sampling import token_logprobs
from primerl.trainer.main import load_parallelism
from primerl.trainer.packing import first_fit_decreasing, pack


def _samples(n, seed=0, min_len=2, max_len=40, vocab=263, experts=None):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        L = rng.randint(min_len, max_len)
        prompt = rng.randint(1, L - 1)
        s = Sample(
            tokens=[rng.randrange(vocab) for _ in range(L)],
            loss_mask=[0] * prompt + [1] * (L - prompt),
            logprobs=[0.0] * prompt + [-rng.random() for _ in range(L - prompt)],
            advantage=rng.uniform(-1, 1),
            temperature=rng.choice([1.0, 0.7]),
        )
        if experts is not None:
            layers, k, E = experts
            s.routed_experts = torch.randint(0, E, (L, layers, k), dtype=torch.uint8)
        out.append(s)
    return out


def test_first_fit_decreasing():
    bins = first_fit_decreasing([5, 3, 7, 2, 4, 1], capacity=8)
    assert sorted(i for b in bins for i in b) == list(range(6))
    assert [sum([5, 3, 7, 2, 4, 1][i] for i in b) for b in bins] == [8, 8, 6]  # 7+1, 5+3, 4+2


def test_pack_is_lossless():
    samples = _samples(50, seed=1)
    seq_len = 64
    p = pack(samples, seq_len)
    R, W = p.input_ids.shape
    assert W <= seq_len and (p.lengths <= seq_len).all()
    assert p.num_tokens == sum(len(s.tokens) - 1 for s in samples)  # only the row tails are padding
    # every loss token appears exactly once, as a target, with its logprob and advantage
    expected = {(i, j) for i, s in enumerate(samples) for j in range(1, len(s.tokens)) if s.loss_mask[j]}
    seen = []
    for r in range(R):
        for c in range(int(p.lengths[r])):
            i, pos = int(p.sample_index[r, c]), int(p.positions[r, c])
            s = samples[i]
            assert int(p.input_ids[r, c]) == s.tokens[pos]
            assert int(p.targets[r, c]) == s.tokens[pos + 1]
            assert float(p.advantages[r, c]) == pytest.approx(s.advantage)
            assert float(p.temperatures[r, c]) == pytest.approx(s.temperature)
            if p.loss_mask[r, c]:
                seen.append((i, pos + 1))
                assert float(p.inference_logprobs[r, c]) == pytest.approx(s.logprobs[pos + 1])
        assert (p.sample_index[r, int(p.lengths[r]) :] == -1).all()
        assert not p.loss_mask[r, int(p.lengths[r]) :].any()
    assert len(seen) == len(set(seen)) and set(seen) == expected
    assert p.num_loss_tokens == len(expected)
    # positions restart at 0 in each segment, and a segment is one sample
    for r in range(R):
        n = int(p.lengths[r])
        for seg in p.segment_ids[r, :n].unique():
            where = (p.segment_ids[r, :n] == seg).nonzero().squeeze(-1)
            assert torch.equal(where, torch.arange(where[0], where[0] + len(where)))  # contiguous
            assert torch.equal(p.positions[r, where], torch.arange(len(where)))
            assert p.sample_index[r, where].unique().numel() == 1


def test_pack_too_long_names_the_fix():
    with pytest.raises(ValueError, match="trainer.seq_len"):
        pack([Sample(tokens=list(range(20)), loss_mask=[1] * 20)], seq_len=10)
    # a sample of exactly seq_len + 1 tokens fits (seq_len positions)
    assert pack([Sample(tokens=list(range(11)), loss_mask=[1] * 11)], seq_len=10).num_tokens == 10


def test_pack_defaults_and_skips():
    """No logprobs reads as 0; a 1-token sample has nothing to predict and is skipped."""
    p = pack([Sample(tokens=[5], loss_mask=[0]), Sample(tokens=[1, 2, 3], loss_mask=[0, 1, 1])], seq_len=8)
    assert p.num_tokens == 2 and p.sample_index[0, :2].tolist() == [1, 1]
    assert p.inference_logprobs[0, :2].tolist() == [0.0, 0.0] and p.temperatures[0, :2].tolist() == [1.0, 1.0]


def test_pack_replay_experts_only_when_all_have_them():
    samples = _samples(6, seed=2, experts=(3, 2, 8))
    p = pack(samples, 64)
    assert p.replay_experts is not None and p.replay_experts.shape[2:] == (3, 2)
    r, c = 0, 0
    i, pos = int(p.sample_index[r, c]), int(p.positions[r, c])
    assert torch.equal(p.replay_experts[r, c], samples[i].routed_experts[pos].to(torch.int16))
    samples[3].routed_experts = None
    assert pack(samples, 64).replay_experts is None


@pytest.fixture(scope="module")
def tiny():
    from primerl.registry import get_registry

    adapter = get_registry().load("model", "glm5")()
    model = adapter.build(ModelConfig(seed=3))
    model.eval()
    return adapter, model


def test_packed_forward_matches_separate_forwards(tiny):
    adapter, model = tiny
    layout = adapter.moe_layout(ModelConfig())
    # lengths up to 60 so some samples exceed the DSA top-k (32) and take the sparse path
    samples = _samples(7, seed=4, min_len=3, max_len=60, vocab=263)
    p = pack(samples, seq_len=128)
    assert p.num_rows >= 2 and p.num_rows < len(samples)  # really packed
    with torch.no_grad():
        packed_lp = torch.zeros_like(p.inference_logprobs)
        for r in range(p.num_rows):
            row = p.row(r)
            out = model(row["input_ids"], row["positions"], row["lengths"], segment_ids=row["segment_ids"])
            packed_lp[r, : int(p.lengths[r])] = token_logprobs(out.logits[0], row["targets"][0], row["temperatures"][0])
            assert out.routed_experts.shape[2:] == (len(layout["moe_layers"]), layout["top_k"])
        for i, s in enumerate(samples):
            t = torch.tensor(s.tokens)[None]
            n = t.shape[1] - 1
            out = model(t[:, :-1], torch.arange(n)[None], torch.tensor([n]))
            alone = token_logprobs(out.logits[0], t[0, 1:], s.temperature)  # [n]
            where = p.sample_index == i
            order = p.positions[where].argsort()
            torch.testing.assert_close(packed_lp[where][order], alone, atol=1e-5, rtol=0)


def test_rl_step_reports_routing_agreement_and_mismatch(tiny):
    """rl_step's routing_agreement: 1.0 when inference routed exactly as the trainer's routers
    do, lower when inference's recorded experts differ; with replay the trainer still
    measures its own routers' agreement (not the forced ids)."""
    import copy

    from primerl.algorithms import build_loss
    from primerl.config import RunConfig
    from primerl.trainer.step import rl_step

    adapter, model = tiny
    samples = _samples(4, seed=9, min_len=6, max_len=30)
    for s in samples:  # the experts this model itself picks for each token
        t = torch.tensor(s.tokens)[None]
        with torch.no_grad():
            s.routed_experts = model(t, torch.arange(t.shape[1])[None], torch.tensor([t.shape[1]])).routed_experts[0]
    cfg = RunConfig()
    for replay in (False, True):
        cfg.trainer.router_replay = replay
        m = copy.deepcopy(model)
        opt = torch.optim.SGD(m.parameters(), lr=0.0)
        stats = rl_step(m, opt, pack(samples, seq_len=128), build_loss("default"), cfg, load_parallelism("single"))
        assert stats["routing_agreement"] == pytest.approx(1.0)
        assert {f"routing_agreement/layer_{i}" for i in range(3)} <= set(stats)
    shifted = [attrs.evolve(s, routed_experts=(s.routed_experts.long() + 1) % 8) for s in samples]
    m = copy.deepcopy(model)
    stats = rl_step(m, torch.optim.SGD(m.parameters(), lr=0.0), pack(shifted, seq_len=128), build_loss("default"), cfg,
                    load_parallelism("single"))
    assert stats["routing_agreement"] < 0.5
    assert stats["mismatch_kl"] > 0  # inference logprobs here are made up, so they mismatch
