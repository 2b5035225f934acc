"""The seams of configuration: one resolver finds every plugin's ``Config``, and the preflight
(building what the config names) is a step of its own after loading.

Every kind whose plugins may declare options (model, env, a source's env, inference backend,
launcher, monitor) goes through :func:`primerl.sections.config_class`, so a plugin's ``Config``
that does not extend its contract's section is refused the same way, in one line, whichever
section selects it.
"""

from __future__ import annotations

import attrs
import pytest

from primerl import hookimpl
from primerl.config import ConfigSources, load_config
from primerl.errors import ConfigError
from primerl.preflight import load_checked, preflight
from primerl.registry import Registry


@attrs.define(kw_only=True)
class NotASection:
    """Options that extend none of primerl's section classes."""

    name: str = "wrong"


class Wrong:
    """What each hook registers as "wrong": a component whose Config is no section."""

    Config = NotASection


class WrongPlugin:
    @staticmethod
    @hookimpl
    def register_models(register):
        register("wrong", Wrong)

    @staticmethod
    @hookimpl
    def register_envs(register):
        register("wrong", Wrong)

    @staticmethod
    @hookimpl
    def register_inference_backends(register):
        register("wrong", Wrong)

    @staticmethod
    @hookimpl
    def register_launchers(register):
        register("wrong", Wrong)

    @staticmethod
    @hookimpl
    def register_monitors(register):
        register("wrong", Wrong)


@pytest.fixture(scope="module")
def registry():
    return Registry.discover(extra=[WrongPlugin])


@pytest.mark.parametrize("overrides,kind,base", [
    ([("model.name", "wrong")], "model", "ModelConfig"),
    ([("env.name", "wrong")], "env", "EnvConfig"),
    ([("orchestrator.sources", '[{name = "w", env = "wrong"}]')], "env", "EnvConfig"),
    ([("inference.backend", "wrong")], "inference_backend", "InferenceConfig"),
    ([("launcher.name", "wrong")], "launcher", "LauncherConfig"),
    ([("monitors.wrong.enabled", "true")], "monitor", "MonitorConfig"),
], ids=["model", "env", "source-env", "inference", "launcher", "monitor"])
def test_every_plugin_section_is_resolved_by_the_one_resolver(registry, overrides, kind, base):
    with pytest.raises(ConfigError) as exc:
        load_config(ConfigSources(overrides=overrides), {"model.name": "glm5"} if kind != "model" else None,
                    registry=registry)
    assert str(exc.value) == (f"{kind} plugin 'wrong' declares Config={NotASection!r}, which is not a subclass "
                              f"of primerl's {base}; fix the plugin")


@pytest.mark.parametrize("key,kind", [("model.name", "model"), ("inference.backend", "inference_backend"),
                                      ("launcher.name", "launcher")])
def test_a_plugin_name_that_is_not_a_string_names_the_key_and_its_origin(key, kind):
    with pytest.raises(ConfigError, match=rf"^{key} = 3 \(from the command line \(--{key}\)\) must be a string: the "
                                          rf"name of an installed {kind} plugin"):
        load_config(ConfigSources(overrides=[(key, "3")]))


def test_the_preflight_builds_what_loading_only_structures():
    """Loading checks types and validators and builds no component; the preflight builds the
    loss with its options and refuses them naming the key and where it was set."""
    origins: dict[str, str] = {}
    bad = [("trainer.loss_options", "{no_such_option = 1}")]
    cfg = load_config(ConfigSources(overrides=bad), origins=origins)
    assert cfg.trainer.loss_options == {"no_such_option": 1}
    with pytest.raises(ConfigError, match=r"^trainer.loss_options \(from the command line "
                                          r"\(--trainer.loss_options\)\) do not fit trainer.loss 'default'"):
        preflight(cfg, origins)
    with pytest.raises(ConfigError, match="do not fit trainer.loss 'default'"):
        load_checked(ConfigSources(overrides=bad))
