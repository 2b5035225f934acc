"""Every loss, off-policy correction and advantage estimator against a direct computation of
its formula: hand-made samples of different lengths with prompt tokens, written out token by
token in float64 (no code shared with primerl's), values and gradients compared; a step
split over forwards gives the same loss; options are checked by the component."""

import math
import re

import attrs
import pytest
import torch

from primerl.algorithms import LossInputs, build_advantage, build_correction, build_loss, compute_advantages

# three samples: (advantage, [(p_trainer, p_engine, trains), ...]); the first tokens of each
# are prompt (trains False: the engine logprob is 0 there, as the packer leaves it)
SAMPLES = [
    (+1.0, [(0.3, 1.0, False), (0.5, 0.4, True), (0.9, 0.5, True), (0.2, 0.7, True)]),
    (-2.0, [(0.4, 1.0, False), (0.1, 0.6, True), (0.6, 0.3, True)]),
    (+0.5, [(0.7, 0.65, True), (0.05, 0.02, True), (0.8, 0.81, True), (0.5, 0.5, True), (0.3, 0.62, True)]),
]
MAX_TOKENS = 8


def flat(samples=SAMPLES):
    lp, lp_inf, adv, mask, sid = [], [], [], [], []
    for i, (a, toks) in enumerate(samples):
        for pt, pi, trains in toks:
            lp.append(math.log(pt))
            lp_inf.append(math.log(pi) if trains else 0.0)
            adv.append(a)
            mask.append(trains)
            sid.append(i)
    return (torch.tensor(lp, dtype=torch.float64, requires_grad=True), torch.tensor(lp_inf, dtype=torch.float64),
            torch.tensor(adv, dtype=torch.float64), torch.tensor(mask), torch.tensor(sid))


def inputs(lp, lp_inf, adv, mask, sid, *, correction=None, samples=SAMPLES, select=None):
    """LossInputs of the whole step (or of the tokens ``select`` picks, with the step's totals)."""
    counts = torch.tensor([float(sum(t[2] for t in toks)) for _, toks in samples], dtype=torch.float64)
    x = LossInputs(logprobs=lp, inference_logprobs=lp_inf, old_logprobs=lp_inf if correction is None else lp.detach(),
                   advantages=adv, loss_mask=mask, weights=torch.ones_like(lp_inf), sample_ids=sid,
                   sample_loss_tokens=counts[sid], step_loss_tokens=float(mask.sum()),
                   step_samples=float((counts > 0).sum()), max_tokens=MAX_TOKENS)
    if select is not None:
        x = attrs.evolve(x, **{k: getattr(x, k)[select] for k in ("logprobs", "inference_logprobs", "old_logprobs",
                                                                    "advantages", "loss_mask", "weights", "sample_ids",
                                                                    "sample_loss_tokens")})
    if correction is not None:
        w, _ = correction.weights(x)
        x = attrs.evolve(x, weights=w)
    return x


def trained(samples=SAMPLES):
    """Per sample: its advantage and its loss tokens (index into the flat tensors, p_trainer, p_engine)."""
    out, k = [], 0
    for a, toks in samples:
        mine = []
        for pt, pi, trains in toks:
            if trains:
                mine.append((k, pt, pi))
            k += 1
        out.append((a, mine))
    return out


def check(loss_name, options, reference, samples=SAMPLES):
    """primerl's loss and the reference (a function of the flat trainer logprobs, float64) agree
    in value and gradient."""
    loss_fn = build_loss(loss_name, options)
    lp, lp_inf, adv, mask, sid = flat(samples)
    loss, metrics = loss_fn(inputs(lp, lp_inf, adv, mask, sid, samples=samples))
    loss.backward()
    ours = lp.grad.clone()
    lp2 = lp.detach().clone().requires_grad_(True)
    ref = reference(lp2)
    ref.backward()
    assert float(loss.detach()) == pytest.approx(float(ref), rel=1e-9, abs=1e-12)
    torch.testing.assert_close(ours, lp2.grad, rtol=1e-9, atol=1e-12)
    return metrics


def clip(v, lo, hi):
    return torch.clamp(v, lo, hi)


def n_tokens(samples=SAMPLES):
    return sum(len(m) for _, m in trained(samples))


def n_samples(samples=SAMPLES):
    return sum(1 for _, m in trained(samples) if m)


# ---- losses -------------------------------------------------------------------------------------------

def test_default_dppo_masks_by_the_probability_change_in_the_advantages_direction():
    low, high, kl = 0.2, 0.3, 0.05

    def ref(lp):
        total, masked = 0.0, 0
        for a, toks in trained():
            for k, _pt, pi in toks:
                dp = math.exp(float(lp[k].detach())) - pi
                keep = not ((a > 0 and dp > high) or (a < 0 and dp < -low))
                masked += not keep
                lr = lp[k] - math.log(pi)
                total = total + (-a * torch.exp(lr) if keep else 0.0) + kl * lr**2
        ref.masked = masked
        return total / n_tokens()

    metrics = check("default", {"dppo_mask_low": low, "dppo_mask_high": high, "kl_tau": kl}, ref)
    assert float(metrics["masked_fraction"]) == ref.masked == 2  # 0.9 vs 0.5 (A > 0), 0.1 vs 0.6 (A < 0)


def test_ipo_masks_both_ways():
    eps = 0.25

    def ref(lp):
        total = 0.0
        for a, toks in trained():
            for k, _pt, pi in toks:
                lr = lp[k] - math.log(pi)
                keep = abs(math.exp(float(lp[k].detach())) - pi) <= eps
                total = total + (-a * torch.exp(lr) if keep else 0.0) + 1e-3 * lr**2
        return total / n_tokens()

    metrics = check("ipo", {"eps": eps}, ref)
    assert float(metrics["masked_fraction"]) == 5  # |dp| = 0.4, 0.5, 0.5, 0.3, 0.3 (against its advantage too)


def clipped_term(r, a, lo, hi):
    return -torch.minimum(r * a, clip(r, 1 - lo, 1 + hi) * a)


@pytest.mark.parametrize("name, lo, hi, norm", [("grpo_clip", 0.2, 0.2, "sequence"), ("dapo", 0.2, 0.28, "token"),
                                                ("dr_grpo", 0.2, 0.2, "constant")])
def test_the_clipped_surrogates_and_their_normalisations(name, lo, hi, norm):
    def ref(lp):
        total, binds = 0.0, 0
        for a, toks in trained():
            seq = 0.0
            for k, _pt, pi in toks:
                r = torch.exp(lp[k] - math.log(pi))
                seq = seq + clipped_term(r, a, lo, hi)
                binds += (a > 0 and float(r.detach()) > 1 + hi) or (a < 0 and float(r.detach()) < 1 - lo)
            total = total + (seq / len(toks) if norm == "sequence" else seq)
        ref.binds = binds
        return total / {"sequence": n_samples(), "token": n_tokens(), "constant": n_samples() * MAX_TOKENS}[norm]

    metrics = check(name, {}, ref)
    assert float(metrics["clipped_fraction"]) == ref.binds > 0


def test_gspo_clips_the_sequences_ratio():
    lo, hi = 0.05, 0.05  # wider than GSPO's defaults so that some sequences bind

    def ref(lp):
        total = 0.0
        for a, toks in trained():
            s = torch.exp(sum(lp[k] - math.log(pi) for k, _pt, pi in toks) / len(toks))
            total = total + clipped_term(s, a, lo, hi)
        return total / n_samples()

    check("gspo", {"clip_low": lo, "clip_high": hi}, ref)
    check("gspo", {}, lambda lp: sum(clipped_term(torch.exp(sum(lp[k] - math.log(pi) for k, _, pi in toks) / len(toks)),
                                                  a, 3e-4, 4e-4) for a, toks in trained()) / n_samples())


def test_cispo_weights_reinforce_by_the_clipped_detached_ratio():
    hi = 0.5

    def ref(lp):
        total = 0.0
        for a, toks in trained():
            for k, pt, pi in toks:
                w = min(pt / pi, 1 + hi)  # no lower bound
                total = total - w * a * lp[k]
        return total / n_tokens()

    metrics = check("cispo", {"clip_high": hi}, ref)
    assert float(metrics["clipped_fraction"]) == 3  # 0.9/0.5, 0.6/0.3, 0.05/0.02 above 1.5

    def ref_low(lp):
        return sum(-min(max(pt / pi, 0.8), 5.0) * a * lp[k] for a, toks in trained() for k, pt, pi in toks) / n_tokens()

    check("cispo", {"clip_low": 0.2}, ref_low)


def test_sapo_gates_softly_with_a_temperature_per_advantage_sign():
    def ref(lp):
        total = 0.0
        for a, toks in trained():
            tau = 1.0 if a > 0 else 1.05
            seq = sum(-(4 / tau) * torch.sigmoid(tau * (torch.exp(lp[k] - math.log(pi)) - 1)) * a for k, _, pi in toks)
            total = total + seq / len(toks)
        return total / n_samples()

    check("sapo", {}, ref)
    # at r = 1 its gradient is the plain policy gradient: -A d log p
    lp, lp_inf, adv, mask, sid = flat()
    on_policy = torch.where(mask, lp.detach(), lp_inf)
    x = inputs(lp, on_policy, adv, mask, sid)
    build_loss("sapo")(x)[0].backward()
    counts = x.sample_loss_tokens
    expected = torch.where(mask, -adv / counts / n_samples(), torch.zeros_like(adv))
    torch.testing.assert_close(lp.grad, expected)


def test_a_step_split_over_forwards_sums_to_the_same_loss():
    """Each forward normalises by the step's totals: the sum over forwards is the whole step's."""
    for name in ("default", "grpo_clip", "dapo", "dr_grpo", "gspo", "cispo", "sapo", "ipo"):
        loss_fn = build_loss(name, {"clip_low": 0.05, "clip_high": 0.05} if name == "gspo" else {})
        lp, lp_inf, adv, mask, sid = flat()
        whole = loss_fn(inputs(lp, lp_inf, adv, mask, sid))[0]
        first, second = sid < 2, sid >= 2  # whole samples per forward, as packed rows give them
        parts = sum(loss_fn(inputs(lp, lp_inf, adv, mask, sid, select=s))[0] for s in (first, second))
        assert float(parts) == pytest.approx(float(whole), rel=1e-9), name


def test_no_loss_token_means_no_loss_and_finite_gradients():
    samples = [(1.0, [(0.5, 1.0, False), (1e-30, 1.0, False)])]  # a prompt only, an absurd ratio on it
    for name in ("default", "grpo_clip", "dapo", "dr_grpo", "gspo", "cispo", "sapo", "ipo"):
        lp, lp_inf, adv, mask, sid = flat(samples)
        loss, _ = build_loss(name)(inputs(lp, lp_inf, adv, mask, sid, samples=samples))
        loss.backward()
        assert float(loss) == 0.0 and torch.isfinite(lp.grad).all() and not lp.grad.any(), name


def test_a_far_off_policy_token_cannot_overflow():
    samples = [(1.0, [(0.9, 1e-30, True), (0.5, 0.5, True)]), (-1.0, [(0.5, 0.5, True)])]
    for name in ("default", "grpo_clip", "dapo", "dr_grpo", "gspo", "cispo", "sapo", "ipo"):
        lp, lp_inf, adv, mask, sid = flat(samples)
        loss, _ = build_loss(name)(inputs(lp, lp_inf, adv, mask, sid, samples=samples))
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(lp.grad).all(), name


# ---- corrections --------------------------------------------------------------------------------------

def rho_token():
    return {k: pt / pi for _, toks in trained() for k, pt, pi in toks}


def rho_sequence(kind="product"):
    out = {}
    for _, toks in trained():
        logs = [math.log(pt / pi) for _, pt, pi in toks]
        value = math.exp(sum(logs) if kind == "product" else sum(logs) / len(logs))
        out.update({k: value for k, _, _ in toks})
    return out


@pytest.mark.parametrize("name, options, expected", [
    ("tis", {"cap": 1.5}, lambda: {k: min(r, 1.5) for k, r in rho_token().items()}),
    ("tis", {"cap": 1.5, "level": "sequence"}, lambda: {k: min(r, 1.5) for k, r in rho_sequence().items()}),
    ("mis", {"cap": 1.5, "floor": 0.5}, lambda: {k: r if 0.5 <= r <= 1.5 else 0.0 for k, r in rho_token().items()}),
    ("mis", {"cap": 1.5, "level": "sequence"}, lambda: {k: r if r <= 1.5 else 0.0 for k, r in rho_sequence().items()}),
    ("mis", {"cap": 1.1, "floor": 0.9, "level": "geometric"},
     lambda: {k: 1.0 if 0.9 <= r <= 1.1 else 0.0 for k, r in rho_sequence("geometric").items()}),
    ("icepop", {}, lambda: {k: r if 0.5 <= r <= 5.0 else 0.0 for k, r in rho_token().items()}),
])
def test_each_correction_weighs_tokens_by_its_formula(name, options, expected):
    lp, lp_inf, adv, mask, sid = flat()
    x = inputs(lp, lp_inf, adv, mask, sid)
    w, metrics = build_correction(name, options).weights(x)
    assert not w.requires_grad
    want = expected()
    for k, value in want.items():
        assert float(w[k]) == pytest.approx(value, rel=1e-9), (name, k)
    assert float(metrics["is_weight/mean"]) == pytest.approx(sum(want.values()), rel=1e-9)
    assert float(metrics["is_weight/max"]) == pytest.approx(max(want.values()), rel=1e-9)
    assert float(metrics["is_masked_fraction"]) == sum(v == 0 for v in want.values())


def test_a_correction_composes_with_any_loss():
    """With a correction the loss's ratio is against the trainer's own (detached) logprobs and
    each token's term is weighted: grpo_clip + tis is sum_i 1/|o_i| sum_t -w_t A_i, over S."""
    tis = build_correction("tis", {"cap": 1.5})
    lp, lp_inf, adv, mask, sid = flat()
    x = inputs(lp, lp_inf, adv, mask, sid, correction=tis)
    loss, metrics = build_loss("grpo_clip")(x)
    loss.backward()
    w = {k: min(r, 1.5) for k, r in rho_token().items()}

    def ref(lp2):
        return sum(-w[k] * torch.exp(lp2[k] - lp2[k].detach()) * a / len(toks)
                   for a, toks in trained() for k, _, _ in toks) / n_samples()

    lp2 = lp.detach().clone().requires_grad_(True)
    r = ref(lp2)
    r.backward()
    assert float(loss) == pytest.approx(float(r)) and float(metrics["clipped_fraction"]) == 0  # r = 1: never clipped
    torch.testing.assert_close(lp.grad, lp2.grad)


@pytest.mark.parametrize("name, options, message", [
    ("grpo_clip", {"clip_low": 1.5}, "clip_low must be in [0, 1)"),
    ("grpo_clip", {"normalise": "token"}, "unexpected keyword argument 'normalise'"),
    ("grpo_clip", {"normalize": "tokens"}, "'normalize' must be in"),
    ("sapo", {"tau_pos": 0}, "tau_pos must be > 0"),
    ("default", {"kl_coef": 0.1}, "unexpected keyword argument 'kl_coef'"),
])
def test_a_loss_checks_its_own_options(name, options, message):
    with pytest.raises((TypeError, ValueError), match=re.escape(message)):
        build_loss(name, options)


def test_a_correction_checks_its_own_options():
    with pytest.raises(ValueError, match=r"floor \(2.0\) must be below cap \(1.5\)"):
        build_correction("mis", {"cap": 1.5, "floor": 2.0})
    with pytest.raises(ValueError, match="'level' must be in"):
        build_correction("tis", {"level": "geometric"})
    assert build_correction("") is None
    assert build_correction("tis", {"level": "sequence"}).sequence_level
    assert build_loss("gspo").sequence_level and not build_loss("dapo").sequence_level


# ---- advantages ---------------------------------------------------------------------------------------

def test_the_advantage_estimators_by_hand():
    groups = [[1.0, 0.0, 0.0, 1.0], [0.2, 0.4, 0.9], [0.7, 0.7], [0.3]]

    def run(name):
        return compute_advantages(groups, build_advantage(name), name)

    assert run("grpo") == [pytest.approx([0.5, -0.5, -0.5, 0.5]), pytest.approx([-0.3, -0.1, 0.4]), [0.0, 0.0], [0.0]]
    s = 0.5 + 1e-6  # population std of [1, 0, 0, 1]
    std3 = math.sqrt((0.3**2 + 0.1**2 + 0.4**2) / 3)
    assert run("grpo_std") == [pytest.approx([0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s]),
                               pytest.approx([-0.3 / (std3 + 1e-6), -0.1 / (std3 + 1e-6), 0.4 / (std3 + 1e-6)]),
                               [0.0, 0.0], [0.0]]
    # leave one out: 1 - mean(0, 0, 1) = 2/3; 0.2 - mean(0.4, 0.9) = -0.45
    assert run("rloo") == [pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3]), pytest.approx([-0.45, -0.15, 0.6]),
                           [0.0, 0.0], [0.0]]
    centred = [0.5, -0.5, -0.5, 0.5, -0.3, -0.1, 0.4, 0.0, 0.0, 0.0]  # the batch's group-centred rewards
    mean = sum(centred) / len(centred)
    std = math.sqrt(sum((c - mean) ** 2 for c in centred) / len(centred))
    assert [a for g in run("reinforce_pp") for a in g] == pytest.approx([(c - mean) / (std + 1e-6) for c in centred])
    assert compute_advantages([], build_advantage("reinforce_pp")) == []
    assert run("reinforce_pp")[2] == pytest.approx([0.0, 0.0])  # a uniform group stays 0


def test_an_estimator_of_the_wrong_shape_is_refused():
    with pytest.raises(ValueError, match=r"returned \[1\] values for groups of \[2\] rewards"):
        compute_advantages([[1.0, 0.0]], lambda groups: [[0.0]], "broken")
