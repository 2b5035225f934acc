"""Prompt trees (``pack(..., share_prompts=True)``): a group's prompt runs once, and the
logprobs, the loss and every gradient equal those of the samples packed whole."""

import copy
import random

import pytest
import torch

from primerl.algorithms import build_loss
from primerl.config import RunConfig
from primerl.models import ModelConfig
from primerl.samples import Sample
from primerl.trainer.main import load_parallelism, share_prompts
from primerl.trainer.packing import pack
from primerl.trainer.step import rl_step, row_forward


def _groups(n_groups, group_size, seed=0, prompt=(6, 30), completion=(1, 40), vocab=263, experts=None):
    """GRPO-like samples: each group's members share a prompt and differ after it."""
    rng = random.Random(seed)
    out = []
    for _ in range(n_groups):
        p = [rng.randrange(vocab) for _ in range(rng.randint(*prompt))]
        shared_routing = None if experts is None else torch.randint(0, experts[2], (len(p), experts[0], experts[1]))
        for _ in range(group_size):
            c = rng.randint(*completion)
            s = Sample(tokens=p + [rng.randrange(vocab) for _ in range(c)], loss_mask=[0] * len(p) + [1] * c,
                       logprobs=[0.0] * len(p) + [-rng.random() for _ in range(c)], advantage=rng.uniform(-1, 1),
                       temperature=rng.choice([1.0, 0.7]))
            if experts is not None:
                own = torch.randint(0, experts[2], (c, experts[0], experts[1]))
                s.routed_experts = torch.cat([shared_routing, own]).to(torch.uint8)
            out.append(s)
    rng.shuffle(out)
    return out


def _loss_tokens(p):
    """{(sample, token index): (input at the position before, its logprob, advantage)} of every loss target."""
    seen = {}
    for r in range(p.num_rows):
        for c in range(int(p.lengths[r])):
            if p.loss_mask[r, c]:
                key = (int(p.sample_index[r, c]), int(p.positions[r, c]) + 1)
                assert key not in seen, "a loss token appears twice"
                seen[key] = (int(p.input_ids[r, c]), int(p.targets[r, c]), float(p.inference_logprobs[r, c]),
                             float(p.advantages[r, c]), float(p.temperatures[r, c]))
    return seen


def test_a_group_shares_its_prompt_and_keeps_every_loss_token_once():
    samples = _groups(5, 8, seed=1)
    whole, trees = pack(samples, 128), pack(samples, 128, share_prompts=True)
    assert whole.prefix_ids is None and trees.prefix_ids is not None
    assert _loss_tokens(trees) == _loss_tokens(whole)
    assert trees.num_loss_tokens == whole.num_loss_tokens
    # each tree holds its prompt's p - 1 positions once; every sample keeps its own from p - 1 on
    prompts = {i: s.loss_mask.index(1) for i, s in enumerate(samples)}
    own = sum(len(s.tokens) - 1 - (prompts[i] - 1) for i, s in enumerate(samples))
    copies = trees.num_tokens - own
    assert trees.num_tokens < whole.num_tokens and copies >= sum({p - 1 for p in prompts.values()})
    for r in range(trees.num_rows):
        n = int(trees.lengths[r])
        seg, pre, pos = trees.segment_ids[r, :n], trees.prefix_ids[r, :n], trees.positions[r, :n]
        for s in seg.unique():
            where = (seg == s).nonzero().squeeze(-1)
            root = int(pre[where[0]])
            assert (pre[where] == root).all()
            if root != int(s):  # a branch: continues its prompt's positions, after it in the row
                prompt_at = (seg == root).nonzero().squeeze(-1)
                assert int(prompt_at[-1]) < int(where[0])
                assert int(pos[where[0]]) == int(pos[prompt_at[-1]]) + 1
                assert not trees.loss_mask[r, prompt_at].any()  # the prompt itself carries no loss


def test_a_group_too_long_for_a_row_becomes_several_trees():
    samples = _groups(1, 8, seed=2, prompt=(20, 20), completion=(30, 30))  # 8 x 30 + 19 > 128
    trees = pack(samples, 128, share_prompts=True)
    assert trees.num_rows == 3  # 3 + 3 + 2 branches, each row with its own copy of the prompt
    assert trees.num_tokens == 3 * 19 + 8 * 30  # each branch: its last prompt token and 29 of its 30 completion tokens
    assert _loss_tokens(trees) == _loss_tokens(pack(samples, 128))


def test_replayed_prompts_routed_differently_are_not_merged():
    samples = _groups(1, 4, seed=3, experts=(3, 2, 8))
    samples[0].routed_experts = samples[0].routed_experts.clone()
    samples[0].routed_experts[0] = (samples[0].routed_experts[0] + 1) % 8  # inference routed its prompt otherwise
    p = pack(samples, 512, share_prompts=True)
    alone = p.sample_index == samples.index(samples[0])
    assert (p.prefix_ids[alone] == p.segment_ids[alone]).all()  # packed whole
    assert (p.prefix_ids != p.segment_ids).any()  # the other three share
    for r in range(p.num_rows):  # each position replays its own sample's experts
        for c in range(int(p.lengths[r])):
            s = samples[int(p.sample_index[r, c])]
            assert torch.equal(p.replay_experts[r, c], s.routed_experts[int(p.positions[r, c])].to(torch.int16))


@pytest.fixture(scope="module", params=["glm5", "kimi", "qwen3-moe"])
def model(request):
    from primerl.registry import get_registry

    m = get_registry().load("model", request.param)().build(ModelConfig(seed=5))
    m.eval()
    return m


@pytest.mark.parametrize("layout", ["segment-per-row", "tree-per-row", "masked-rows"])
def test_tree_logprobs_equal_whole_samples(model, layout, monkeypatch):
    """Every attention layout of prompt trees: each segment a row facing its prompt's keys
    (what these rows choose), one tree per row masked within, and the packed rows' mask;
    prompts and completions long enough that GLM-5's DSA indexer selects keys (top-k 32)."""
    from primerl.models import batch as batch_module

    samples = _groups(3, 5, seed=4, prompt=(20, 40), completion=(10, 50))
    if layout == "tree-per-row":
        monkeypatch.setattr(batch_module, "_tree_segments", lambda *args: None)
    p = pack(samples, 512, share_prompts=True)
    chosen = batch_module.make_batch(p.positions, p.lengths, p.segment_ids, None, None, None,
                                     unpack_segments=layout != "masked-rows", prefix_ids=p.prefix_ids)
    assert (chosen.segments is None) == (layout == "masked-rows")
    if chosen.segments is not None:
        assert (chosen.segments.batch.gather_keys is not None) == (layout == "segment-per-row")
    model.unpack_segments = layout != "masked-rows"
    try:
        out = {}
        for share in (False, True):
            p = pack(samples, 512, share_prompts=share)
            lps = {}
            with torch.no_grad():
                for r in range(p.num_rows):
                    row = p.row(r)
                    lp, _ = row_forward(model, row, replay=False)
                    for c in range(int(p.lengths[r])):
                        if row["loss_mask"][0, c]:
                            lps[(int(row["sample_index"][0, c]), int(row["positions"][0, c]))] = lp[0, c]
            out[share] = lps
    finally:
        model.unpack_segments = True
    assert out[True].keys() == out[False].keys()
    keys = sorted(out[False])
    torch.testing.assert_close(torch.stack([out[True][k] for k in keys]), torch.stack([out[False][k] for k in keys]),
                               atol=2e-5, rtol=0)


@pytest.mark.parametrize("layout", ["segment-per-row", "tree-per-row"])
def test_tree_step_has_the_same_loss_and_gradients(model, layout, monkeypatch):
    from primerl.models import batch as batch_module

    samples = _groups(4, 8, seed=6, prompt=(10, 30), completion=(3, 30))
    if layout == "tree-per-row":
        monkeypatch.setattr(batch_module, "_tree_segments", lambda *args: None)
    p = pack(samples, 256, share_prompts=True)
    chosen = batch_module.make_batch(p.positions, p.lengths, p.segment_ids, None, None, None, unpack_segments=True,
                                     prefix_ids=p.prefix_ids).segments
    assert chosen is not None and (chosen.batch.gather_keys is not None) == (layout == "segment-per-row")
    cfg = RunConfig()
    cfg.trainer.micro_batch_rows = 4
    grads, stats = {}, {}
    for share in (False, True):
        m = copy.deepcopy(model)
        m.train()
        packed = pack(samples, 256, share_prompts=share)
        stats[share] = rl_step(m, torch.optim.SGD(m.parameters(), lr=0.0), packed, build_loss("default"), cfg,
                               load_parallelism("single"))
        grads[share] = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    assert stats[True]["loss"] == pytest.approx(stats[False]["loss"], abs=1e-6)
    assert stats[True]["mismatch_kl"] == pytest.approx(stats[False]["mismatch_kl"], rel=1e-4)
    assert grads[True].keys() == grads[False].keys()
    for name, g in grads[False].items():
        torch.testing.assert_close(grads[True][name], g, atol=1e-6, rtol=1e-4, msg=name)


def test_models_with_recurrent_layers_pack_whole_samples():
    from primerl.registry import get_registry

    nemotron = get_registry().load("model", "nemotron")().build(ModelConfig(seed=1))
    cfg = RunConfig()
    assert share_prompts(cfg, nemotron) is False
    p = pack(_groups(1, 3, seed=7), 128, share_prompts=True)
    row = p.row(0)
    with pytest.raises(ValueError, match="Mamba layer cannot run prompt trees"), torch.no_grad():
        row_forward(nemotron, row, replay=False)
    glm5 = get_registry().load("model", "glm5")().build(ModelConfig(seed=1))
    assert share_prompts(cfg, glm5) is True
    cfg.trainer.share_prompts = False
    assert share_prompts(cfg, glm5) is False


def test_joined_rows_keep_every_segment_apart():
    """join_rows lays rows end to end: the tails go, each row's segment (and prefix) ids
    follow the previous row's, and an empty row stays one position of its own segment."""
    from primerl.trainer.packing import join_rows

    p = pack(_groups(3, 4, seed=8), 64, share_prompts=True)
    rows = p.select([*range(p.num_rows), None])
    joined = join_rows(rows)
    n = int(rows["lengths"].sum())
    assert joined["input_ids"].shape == (1, n) and joined["lengths"].tolist() == [n]
    assert joined["replay_experts"] is None and rows["prefix_ids"] is not None
    seg, pre = joined["segment_ids"][0], joined["prefix_ids"][0]
    assert (seg[1:] >= seg[:-1]).all() and (pre <= seg).all() and (pre >= 0).all()
    offset = 0
    for r, length in enumerate(rows["lengths"].tolist()):
        own = slice(offset, offset + length)
        assert torch.equal(joined["input_ids"][0, own], rows["input_ids"][r, :length])
        assert torch.equal(joined["positions"][0, own], rows["positions"][r, :length])
        # a row's segments are its own: none shares an id with another row's
        assert set(seg[own].tolist()).isdisjoint(seg[:offset].tolist())
        offset += length
    assert joined["sample_index"][0, -1] == -1  # the empty row


@pytest.mark.parametrize("name", ["glm5", "kimi", "qwen3-moe", "qwen3", "minimax", "nemotron", "llama"])
def test_a_step_over_joined_rows_has_the_same_loss_and_gradients(name):
    """Each forward's rows as one row without padding (the models' varlen_rows): the same
    loss, mismatch and gradients as the padded rows, prompt trees included."""
    from primerl.registry import get_registry

    adapter = get_registry().load("model", name)()
    assert adapter.capabilities(ModelConfig()).varlen_rows
    model = adapter.build(ModelConfig(seed=5))
    samples = _groups(4, 6, seed=9, prompt=(10, 30), completion=(3, 30))
    cfg = RunConfig()
    cfg.trainer.micro_batch_rows = 3
    grads, stats = {}, {}
    for join in (False, True):
        m = copy.deepcopy(model)
        m.train()
        packed = pack(samples, 128, share_prompts=share_prompts(cfg, m))
        assert packed.num_rows > 1 and packed.num_tokens < packed.input_ids.numel()  # rows with tails
        stats[join] = rl_step(m, torch.optim.SGD(m.parameters(), lr=0.0), packed, build_loss("default"), cfg,
                              load_parallelism("single"), join=join)
        grads[join] = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    assert stats[True]["loss"] == pytest.approx(stats[False]["loss"], abs=1e-6)
    assert stats[True]["mismatch_kl"] == pytest.approx(stats[False]["mismatch_kl"], rel=1e-4)
    assert grads[True].keys() == grads[False].keys()
    for n, g in grads[False].items():
        torch.testing.assert_close(grads[True][n], g, atol=1e-5, rtol=1e-4, msg=n)
