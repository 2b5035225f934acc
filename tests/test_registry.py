"""Discovery and lookup of components registered in-process (installed plugins: test_installed_plugins)."""

import sys

import pytest

from primerl import hookimpl
from primerl.envs import SingleTurnEnv, Task
from primerl.errors import PluginError
from primerl.registry import KINDS, Registry


class Good:
    __name__ = "good"

    @hookimpl
    def register_envs(self, register):
        register("good-env", GoodEnv)

    @hookimpl
    def register_routers(self, register):
        register("lazy-router", "primerl_no_such_module_xyz:Router", description="lazy")


class GoodEnv(SingleTurnEnv):
    """A test env."""

    def tasks(self, split):
        yield Task(id="1", prompt="hi", answer="hi")

    def reward(self, task, completion):
        return 1.0


class Rival:
    __name__ = "rival"

    @hookimpl
    def register_envs(self, register):
        register("good-env", "tests.whatever:Env")


class WrongSignature:
    __name__ = "wrong-signature"

    @hookimpl
    def register_envs(self, reg):  # must be called `register`
        reg("x", object)


class UnknownHook:
    __name__ = "unknown-hook"

    @hookimpl
    def register_environments(self, register):
        register("x", object)


class Raises:
    __name__ = "raises"

    @hookimpl
    def register_models(self, register):
        raise RuntimeError("boom")


def discover(*plugins):
    return Registry.discover(plugins, installed=False)


def test_every_kind_has_a_hook():
    import primerl.hookspecs as hs
    from primerl.registry import HOOK_KINDS

    hooks = [n for n in dir(hs) if n.startswith("register_")]
    assert set(hooks) == set(HOOK_KINDS) and len(hooks) == len(KINDS) >= 11


def test_registers_and_finds_components():
    reg = discover(Good())
    env = reg.find("env", "good-env")
    assert env.status == "ok" and env.plugin == "good"
    assert env.description == "A test env."
    assert reg.load("env", "good-env") is GoodEnv


def test_lazy_target_is_not_imported_until_loaded():
    reg = discover(Good())
    router = reg.find("router", "lazy-router")
    assert router.status == "ok"
    assert "primerl_no_such_module_xyz" not in sys.modules
    with pytest.raises(PluginError, match="could not load its target 'primerl_no_such_module_xyz:Router'"):
        router.load()


def test_unknown_name_lists_what_is_available():
    reg = discover(Good())
    with pytest.raises(PluginError, match="no env named 'nope'. Available: good-env"):
        reg.find("env", "nope")


def test_duplicate_names_are_an_error_naming_both_and_a_qualified_name_picks_one():
    reg = discover(Good(), Rival())
    rows = [c for c in reg.components if c.name == "good-env"]
    assert len(rows) == 2 and all(c.status == "error" for c in rows)
    with pytest.raises(PluginError) as err:
        reg.find("env", "good-env")
    assert "plugin 'good'" in str(err.value) and "plugin 'rival'" in str(err.value)
    assert "good:good-env" in str(err.value)
    assert reg.load("env", "good:good-env") is GoodEnv
    assert reg.find("env", "rival:good-env").target == "tests.whatever:Env"


@pytest.mark.parametrize(
    "plugin, kind, message",
    [
        (WrongSignature(), "env", "invalid hook implementation"),
        (UnknownHook(), None, "unknown hook(s) register_environments"),
        (Raises(), "model", "register_models raised RuntimeError: boom"),
    ],
)
def test_broken_plugins_are_reported_not_fatal(plugin, kind, message):
    reg = discover(Good(), plugin)
    assert reg.find("env", "good-env").status == "ok"  # the healthy plugin still works
    broken = [c for c in reg.components if c.plugin == plugin.__name__]
    assert broken and all(c.status == "error" for c in broken)
    assert message in broken[0].error
    if kind:
        assert broken[0].kind == kind
        with pytest.raises(PluginError, match="unavailable|broken"):
            reg.find(kind, broken[0].name)


def test_allow_and_deny_lists(monkeypatch):
    monkeypatch.setenv("PRIMERL_PLUGINS", "rival")
    assert {c.plugin for c in discover(Good(), Rival()).components} == {"rival"}
    monkeypatch.delenv("PRIMERL_PLUGINS")
    monkeypatch.setenv("PRIMERL_DISABLE_PLUGINS", "rival")
    reg = discover(Good(), Rival())
    assert reg.find("env", "good-env").plugin == "good"  # no conflict once rival is denied
    monkeypatch.setenv("PRIMERL_PLUGINS", "")
    assert discover(Good()).components == []


def test_register_rejects_bad_targets():
    class BadTarget:
        __name__ = "bad-target"

        @hookimpl
        def register_envs(self, register):
            register("x", "no_colon_here")

    reg = discover(BadTarget())
    assert reg.components[0].status == "error"
    assert "module:attr" in reg.components[0].error


def test_env_contract_validates_tasks_and_rewards():
    with pytest.raises(ValueError, match="list of chat messages"):
        Task(id="1", prompt=[{"content": "no role"}])
    t = Task(id="1", prompt="hi")
    assert t.messages("sys") == [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]

    class Bad(GoodEnv):
        def reward(self, task, completion):
            return 2.0

    with pytest.raises(ValueError, match="rewards must be in \\[0, 1\\]"):
        Bad().score(t, "x")
