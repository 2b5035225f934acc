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


ALGORITHM_MODULES = ("advantages", "corrections", "losses", "options", "shaping")


def test_the_algorithm_modules_declare_what_they_export_and_the_package_exports_the_contracts():
    """primerl.algorithms is where a plugin finds the algorithm kinds: each module's __all__
    lists every public name it defines (and only names it has); the package exports the
    Protocols, the loss's record and the builders."""
    import importlib

    import primerl.algorithms as algorithms

    for name in ALGORITHM_MODULES:
        module = importlib.import_module(f"primerl.algorithms.{name}")
        assert [n for n in module.__all__ if not hasattr(module, n)] == [], name
        defined = {n for n, v in vars(module).items()
                   if not n.startswith("_") and getattr(v, "__module__", None) == module.__name__}
        assert defined - set(module.__all__) == set(), name
    assert [n for n in algorithms.__all__ if not hasattr(algorithms, n)] == []
    assert {"Loss", "LossInputs", "reduce", "Correction", "Advantage", "OverlongShaping", "build_loss",
            "build_correction", "build_advantage"} <= set(algorithms.__all__)


def test_docs_name_every_export_of_the_algorithms_package_and_every_member_of_its_contracts():
    """docs/plugins.md's algorithm sections name what a loss, correction or advantage plugin
    codes against: the package's exports, and each member of the Protocols and of LossInputs."""
    import re

    from conftest import REPO

    import primerl.algorithms as algorithms
    from primerl.algorithms import Advantage, Correction, Loss, LossInputs

    text = (REPO / "docs" / "plugins.md").read_text()
    sections = {hook: text.split(f"### `{hook}(register)`", 1)[1].split("\n### ", 1)[0]
                for hook in ("register_losses", "register_corrections", "register_advantages")}
    everything = "".join(sections.values())
    assert [n for n in algorithms.__all__ if not re.search(rf"`{n}\b", everything)] == []

    def members(cls):
        return {n for n in [*vars(cls), *getattr(cls, "__annotations__", {})] if not n.startswith("_")}

    missing = {}
    for hook, classes in (("register_losses", [Loss, LossInputs]), ("register_corrections", [Correction]),
                          ("register_advantages", [Advantage])):
        for cls in classes:
            names = sorted(m for m in members(cls) if not re.search(rf"\b{m}\b", sections[hook]))
            if names:
                missing[f"{hook}: {cls.__name__}"] = names
    assert missing == {}
