"""The default loss and the advantage estimators, against hand computations; lookup by
registered name (the built-ins' plugin, an in-process plugin) and by "module:attr"."""

import math
import subprocess
import sys

import pytest
import torch

from primerl import hookimpl, registry
from primerl.advantages import compute_advantages, grpo, grpo_std
from primerl.config import TrainerConfig
from primerl.errors import PluginError
from primerl.registry import Registry
from primerl.trainer.loss import default_loss, get_loss

# (p_train, p_infer, advantage, loss_mask) with mask_threshold 0.2:
ROWS = [
    (0.5, 0.4, +1.0, 1),  # kept: moved up 0.1 <= 0.2
    (0.9, 0.5, +1.0, 1),  # masked: A > 0 and p went up by 0.4 > 0.2
    (0.1, 0.6, -1.0, 1),  # masked: A < 0 and p went down by 0.5 > 0.2
    (0.6, 0.3, -2.0, 1),  # kept: A < 0 but p went *up* (against the advantage)
    (0.2, 0.7, +1.0, 1),  # kept: A > 0 but p went *down*
    (0.9, 1.0, +1.0, 0),  # not a loss token (prompt): inference logprob 0.0
]


def _inputs():
    lp = torch.tensor([math.log(r[0]) for r in ROWS], requires_grad=True)
    lp_inf = torch.tensor([math.log(r[1]) for r in ROWS])
    adv = torch.tensor([r[2] for r in ROWS])
    mask = torch.tensor([bool(r[3]) for r in ROWS])
    return lp, lp_inf, adv, mask


def test_default_loss_by_hand():
    cfg = TrainerConfig(mask_threshold=0.2, kl_coef=0.1)
    lp, lp_inf, adv, mask = _inputs()
    loss, metrics = default_loss(lp, lp_inf, adv, mask, config=cfg, normalizer=5.0)

    def term(p, q, a):  # -A r + kl (log r)^2
        return -a * (p / q) + 0.1 * math.log(p / q) ** 2

    expected = (term(0.5, 0.4, 1.0) + term(0.6, 0.3, -2.0) + term(0.2, 0.7, 1.0)) / 5
    assert expected == pytest.approx((-1.25 + 0.1 * math.log(1.25) ** 2 + 4 + 0.1 * math.log(2) ** 2
                                      - 2 / 7 + 0.1 * math.log(2 / 7) ** 2) / 5)
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert float(metrics["masked_fraction"]) == 2  # a token sum: the trainer divides by 5
    k3 = sum(p / q - math.log(p / q) - 1 for p, q, _, m in ROWS if m)
    assert float(metrics["mismatch_kl"]) == pytest.approx(k3, rel=1e-5)

    # gradient: d/d lp of (-A r + c (log r)^2) / N = (-A r + 2 c log r) / N on kept tokens, 0 elsewhere
    loss.backward()
    want = [(-a * (p / q) + 2 * 0.1 * math.log(p / q)) / 5 if i in (0, 3, 4) else 0.0
            for i, (p, q, a, _) in enumerate(ROWS)]
    torch.testing.assert_close(lp.grad, torch.tensor(want), rtol=1e-5, atol=1e-7)
    # descent raises the logprob of kept positive-advantage tokens and lowers negative ones
    assert lp.grad[0] < 0 and lp.grad[4] < 0 and lp.grad[3] > 0


def test_no_kl_and_identical_policies():
    cfg = TrainerConfig(kl_coef=0.0)
    lp = torch.log(torch.tensor([0.3, 0.6, 0.9])).requires_grad_()
    adv = torch.tensor([1.0, -1.0, 0.5])
    mask = torch.tensor([True, True, True])
    loss, metrics = default_loss(lp, lp.detach().clone(), adv, mask, config=cfg, normalizer=3.0)
    assert loss.item() == pytest.approx(-(1 - 1 + 0.5) / 3)  # r = 1 everywhere
    assert float(metrics["mismatch_kl"]) == pytest.approx(0.0, abs=1e-7)
    loss.backward()
    torch.testing.assert_close(lp.grad, -adv / 3)  # the policy gradient: -A / N


def test_huge_ratio_on_masked_token_gives_no_nan():
    cfg = TrainerConfig()
    lp = torch.tensor([-0.01, -0.5], requires_grad=True)
    lp_inf = torch.tensor([-200.0, -0.5])  # ratio e^200 = inf in float32, but masked (A > 0, moved up)
    loss, _ = default_loss(lp, lp_inf, torch.tensor([1.0, 1.0]), torch.tensor([True, True]),
                           config=cfg, normalizer=2.0)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all() and lp.grad[0] == 0


def test_advantages_by_hand():
    assert compute_advantages([1.0, 0.0, 0.0, 1.0], "grpo") == pytest.approx([0.5, -0.5, -0.5, 0.5])
    assert compute_advantages([0.2, 0.4, 0.9], "grpo") == pytest.approx([-0.3, -0.1, 0.4])
    std = 0.5  # population std of [1, 0, 0, 1]
    assert compute_advantages([1.0, 0.0, 0.0, 1.0], "grpo_std") == pytest.approx(
        [0.5 / (std + 1e-6), -0.5 / (std + 1e-6), -0.5 / (std + 1e-6), 0.5 / (std + 1e-6)]
    )
    assert compute_advantages([0.7, 0.7], "grpo_std") == [0.0, 0.0]  # no signal, no blow-up
    assert compute_advantages([], "grpo") == []


def test_builtins_are_registered_by_the_core_plugin():
    """Installed discovery finds the core distribution's own plugin like any other."""
    reg = registry.get_registry()
    assert reg.load("loss", "default") is default_loss is get_loss("default")
    assert reg.load("advantage", "grpo") is grpo and reg.load("advantage", "grpo_std") is grpo_std
    assert {c.plugin for c in reg.of_kind("loss") + reg.of_kind("advantage") if c.name in ("default", "grpo")} \
        == {"primerl"}
    assert get_loss("primerl:default") is default_loss  # a PLUGIN:NAME pick


def clipped(logprobs, inference_logprobs, advantages, loss_mask, *, config, normalizer):
    """A third party's loss."""
    return (-(advantages * logprobs)[loss_mask]).sum() / normalizer, {}


class LossPlugin:
    __name__ = "my-losses"

    @hookimpl
    def register_losses(self, register):
        register("clipped", clipped)

    @hookimpl
    def register_advantages(self, register):
        register("rank", _rank)


def _rank(rewards):
    order = sorted(range(len(rewards)), key=rewards.__getitem__)
    return [float(order.index(i)) for i in range(len(rewards))]


@pytest.fixture
def with_plugin(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", Registry.discover(extra=[LossPlugin()]))


def test_a_plugin_registers_a_loss_and_an_advantage(with_plugin):
    assert get_loss("clipped") is clipped and get_loss("my-losses:clipped") is clipped
    assert compute_advantages([0.5, 0.1, 0.9], "rank") == [1.0, 0.0, 2.0]
    assert get_loss("default") is default_loss  # the installed built-ins are still there
    with pytest.raises(PluginError, match=r"no loss named 'nope'\. Available: clipped, default"):
        get_loss("nope")


def test_custom_by_module_attr_and_errors():
    assert compute_advantages([1.0, 3.0], "primerl.advantages:grpo") == [-1.0, 1.0]
    assert get_loss("primerl.trainer.loss:default_loss") is default_loss
    with pytest.raises(PluginError, match="orchestrator.advantage: no advantage named 'rloo'. Available: grpo, grpo_std"):
        compute_advantages([1.0], "rloo")
    with pytest.raises(PluginError, match="could not be loaded as 'module:attr'.*no_such_module_xyz"):
        get_loss("no_such_module_xyz:f")
    with pytest.raises(PluginError, match="not callable"):
        get_loss("primerl.trainer.loss:__doc__")


def test_advantages_and_the_loss_module_import_no_torch():
    """The orchestrator computes advantages without torch; the loss module loads it lazily."""
    code = ("import sys, primerl.advantages as a, primerl.trainer.loss; a.compute_advantages([1.0, 0.0]); "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
