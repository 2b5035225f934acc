"""Losses, corrections and advantages by name: the built-ins' plugin, an in-process plugin,
"module:attr" factories, the lookup's errors (each formula is tested in test_algorithms.py)."""

import subprocess
import sys

import attrs
import pytest

from primerl import hookimpl, registry
from primerl.algorithms import build_advantage, build_correction, build_loss, compute_advantages
from primerl.algorithms.advantages import GRPO, RLOO
from primerl.algorithms.corrections import TIS
from primerl.algorithms.losses import DefaultLoss
from primerl.builtin_plugin import ADVANTAGES, CORRECTIONS, LOSSES
from primerl.errors import PluginError
from primerl.registry import Registry


def test_builtins_are_registered_by_the_core_plugin():
    """Installed discovery finds the core distribution's own plugin like any other."""
    reg = registry.get_registry()
    assert reg.load("loss", "default") is DefaultLoss and isinstance(build_loss("default"), DefaultLoss)
    assert reg.load("advantage", "grpo") is GRPO and reg.load("advantage", "rloo") is RLOO
    assert reg.load("correction", "tis") is TIS
    for kind, names in (("loss", LOSSES), ("correction", CORRECTIONS), ("advantage", ADVANTAGES)):
        assert {c.name for c in reg.of_kind(kind) if c.plugin == "primerl"} == set(names)
    assert isinstance(build_loss("primerl:default"), DefaultLoss)  # a PLUGIN:NAME pick


@attrs.frozen(kw_only=True)
class Reinforce:
    """A third party's loss: plain REINFORCE, one option."""

    scale: float = 1.0
    sequence_level = False

    def __call__(self, x):
        return -(self.scale * x.weights * x.advantages * x.logprobs)[x.loss_mask].sum() / x.step_loss_tokens, {}


@attrs.frozen
class Rank:
    def __call__(self, groups):
        return [[float(sorted(g).index(r)) for r in g] for g in groups]


class LossPlugin:
    __name__ = "my-losses"

    @hookimpl
    def register_losses(self, register):
        register("reinforce", Reinforce)

    @hookimpl
    def register_advantages(self, register):
        register("rank", Rank)


@pytest.fixture
def with_plugin(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", Registry.discover(extra=[LossPlugin()]))


def test_a_plugin_registers_a_loss_and_an_advantage(with_plugin):
    assert build_loss("reinforce", {"scale": 2.0}) == Reinforce(scale=2.0)
    assert isinstance(build_loss("my-losses:reinforce"), Reinforce)
    assert compute_advantages([[0.5, 0.1, 0.9]], build_advantage("rank")) == [[1.0, 0.0, 2.0]]
    assert isinstance(build_loss("default"), DefaultLoss)  # the installed built-ins are still there
    with pytest.raises(PluginError, match=r"no loss named 'nope'\. Available: cispo, dapo, default"):
        build_loss("nope")


def test_custom_by_module_attr_and_errors():
    assert compute_advantages([[1.0, 3.0]], build_advantage("primerl.algorithms.advantages:GRPO")) == [[-1.0, 1.0]]
    assert isinstance(build_loss("primerl.algorithms.losses:DefaultLoss", {"kl_tau": 0.1}), DefaultLoss)
    assert isinstance(build_correction("primerl.algorithms.corrections:TIS"), TIS)
    with pytest.raises(PluginError, match="orchestrator.advantage: no advantage named 'loo'. Available: grpo, grpo_std"):
        build_advantage("loo")
    with pytest.raises(PluginError, match="trainer.correction: no correction named 'tiss'"):
        build_correction("tiss")
    with pytest.raises(PluginError, match="could not be loaded as 'module:attr'.*no_such_module_xyz"):
        build_loss("no_such_module_xyz:f")
    with pytest.raises(PluginError, match="not callable"):
        build_loss("primerl.algorithms.losses:__doc__")


def test_advantages_and_the_algorithm_modules_import_no_torch():
    """The orchestrator computes advantages without torch; the loss and correction modules
    load it lazily (a config check builds them)."""
    code = ("import sys, primerl.algorithms as a, primerl.orchestrator.advantages, primerl.orchestrator.filters; "
            "a.compute_advantages([[1.0, 0.0]], a.build_advantage('rloo')); a.build_loss('gspo'); "
            "a.build_correction('tis'); assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
