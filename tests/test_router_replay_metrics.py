"""The router replay benchmark's metrics (bench/router_replay.py) on hand-made logprobs and
routings: k3 exact values, the |log r| > ln 2 share, max |log r|, routing-flip share and
the bootstrap intervals."""

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench" / "router_replay.py"


@pytest.fixture(scope="module")
def rr():
    spec = importlib.util.spec_from_file_location("router_replay_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_k3_exact_values(rr):
    # r = 2: 2 - 1 - ln 2; r = 1/2: 1/2 - 1 + ln 2; r = 1: 0; r = e: e - 2
    infer = torch.log(torch.tensor([0.25, 0.5, 0.3, 0.1], dtype=torch.float64))
    train = torch.log(torch.tensor([0.5, 0.25, 0.3, 0.1 * math.e], dtype=torch.float64))
    got = rr.k3(train, infer)
    want = torch.tensor([1 - math.log(2), math.log(2) - 0.5, 0.0, math.e - 2], dtype=torch.float64)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)


def test_k3_small_ratio_is_half_square_and_float32_inputs_are_promoted(rr):
    log_r = torch.tensor([1e-4, -1e-4], dtype=torch.float32)
    got = rr.k3(log_r, torch.zeros(2))
    # k3 = r - 1 - log r = x^2/2 + x^3/6 + ...; in float32 the subtraction would lose it all
    want = log_r.double() ** 2 / 2 + log_r.double() ** 3 / 6
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert (got > 0).all()


def test_metrics_share_above_ln2_and_max(rr):
    ln2 = math.log(2)
    log_r = torch.tensor([0.0, 0.5, -0.7, 0.7, -1.0, 2.0, ln2 + 1e-9, ln2], dtype=torch.float64)
    m = rr.metrics(log_r)
    # strictly above ln 2 in absolute value: -0.7 (0.7 > 0.693), 0.7, -1.0, 2.0, ln 2 + 1e-9
    assert m["gt_ln2"] == pytest.approx(5 / 8)
    assert m["max_abs_log_ratio"] == pytest.approx(2.0)
    assert m["kl"] == pytest.approx(float((torch.expm1(log_r) - log_r).mean()), rel=1e-12)


def test_flipped_compares_sets_in_any_layer(rr):
    # 4 tokens, 3 MoE layers, top-2
    inference = torch.tensor([
        [[0, 1], [2, 3], [4, 5]],
        [[0, 1], [2, 3], [4, 5]],
        [[0, 1], [2, 3], [4, 5]],
        [[6, 7], [6, 7], [6, 7]],
    ], dtype=torch.uint8)
    own = torch.tensor([
        [[1, 0], [3, 2], [5, 4]],  # same sets, other order: no flip
        [[0, 1], [2, 3], [4, 6]],  # last layer differs
        [[0, 2], [2, 3], [4, 5]],  # first layer differs
        [[6, 7], [6, 7], [6, 7]],  # identical
    ], dtype=torch.int16)
    assert rr.flipped(own, inference).tolist() == [False, True, True, False]


def test_summarize_figures_and_intervals(rr):
    # 3 prompts; tokens with known log ratios; one flipped token carries the big mismatch
    log_r_no = torch.tensor([0.0, 0.1, -0.1, 1.0, 0.0, 0.2], dtype=torch.float64)
    log_r_r3 = torch.tensor([0.0, 0.1, -0.1, 0.05, 0.0, 0.2], dtype=torch.float64)
    flip = torch.tensor([False, False, False, True, False, False])
    groups = np.array([0, 0, 1, 1, 2, 2])
    s = rr.summarize(groups, log_r_no, log_r_r3, flip, reps=500, seed=1)
    def k3(x):
        return math.exp(x) - 1 - x

    kl_no = sum(k3(x) for x in log_r_no.tolist()) / 6
    kl_r3 = sum(k3(x) for x in log_r_r3.tolist()) / 6
    assert s["tokens"] == 6 and s["prompts"] == 3
    assert s["kl_no_r3"] == pytest.approx(kl_no, rel=1e-12)
    assert s["kl_r3"] == pytest.approx(kl_r3, rel=1e-12)
    assert s["kl_reduction"] == pytest.approx(kl_no / kl_r3, rel=1e-12)
    assert s["gt_ln2_no_r3"] == pytest.approx(1 / 6) and s["gt_ln2_r3"] == 0.0
    assert s["max_abs_log_ratio_no_r3"] == pytest.approx(1.0) and s["max_abs_log_ratio_r3"] == pytest.approx(0.2)
    assert s["flip_share"] == pytest.approx(1 / 6)
    assert s["kl_no_r3_flipped"] == pytest.approx(k3(1.0)) and s["kl_r3_flipped"] == pytest.approx(k3(0.05))
    assert s["flipped_kl_share"] == pytest.approx(k3(1.0) / (6 * kl_no))
    assert s["kl_no_r3_unflipped"] == pytest.approx(sum(k3(x) for x in (0.0, 0.1, -0.1, 0.0, 0.2)) / 5)
    for name in ("kl_no_r3", "kl_r3", "kl_reduction", "gt_ln2_no_r3", "flip_share"):
        lo, hi = s[f"{name}_ci"]
        assert lo <= s[name] <= hi, name
    # prompt 1 holds the only flipped token: resamples without it give flip share 0
    assert s["flip_share_ci"][0] == 0.0
    assert s["gt_ln2_r3_ci"] == [0.0, 0.0]


def test_bootstrap_resamples_whole_groups(rr):
    # every token of a group has the group's value: resampled means are means of group values
    groups = np.repeat(np.arange(4), 5)
    values = np.repeat(np.array([0.0, 1.0, 2.0, 3.0]), 5)
    ci = rr.bootstrap(groups, {"v": values}, {}, reps=2000, seed=0, level=0.9)
    lo, hi = ci["v"]
    assert 0.0 <= lo < 1.5 < hi <= 3.0
    # constant values: a zero-width interval; a ratio of identical columns: exactly 1
    ci = rr.bootstrap(groups, {"a": np.full(20, 0.25), "b": np.full(20, 0.25)}, {"a/b": ("a", "b")}, reps=100)
    assert ci["a"] == pytest.approx((0.25, 0.25)) and ci["a/b"] == pytest.approx((1.0, 1.0))


def test_bootstrap_is_seeded(rr):
    groups = np.arange(50)
    values = np.random.default_rng(3).random(50)
    a = rr.bootstrap(groups, {"v": values}, {}, reps=300, seed=7)
    b = rr.bootstrap(groups, {"v": values}, {}, reps=300, seed=7)
    assert a == b


def test_large_routing_shape_builds_every_model(rr):
    from primerl.registry import get_registry

    for name in rr.ARCHS:
        adapter = get_registry().load("model", name)()
        hf = rr.routing_shape(name, adapter.hf_config("tiny"), 16, 4, 24, 8)
        model = adapter.build_from_hf(hf, seed=0)
        assert len(model.moe_layers) == 24, name
        assert model.config.num_experts_per_tok == 4
