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
from primerl.envs import SingleTurnEnv
from primerl.errors import ConfigError
from primerl.inference import InferenceConfig
from primerl.launchers import LauncherConfig
from primerl.preflight import load_checked, preflight
from primerl.registry import Registry


@attrs.define(kw_only=True)
class NotASection:
    """Options that extend none of primerl's section classes."""

    name: str = "wrong"


class Wrong:
    """What each hook registers as "wrong": a component whose Config is no section."""

    Config = NotASection


class Bare:
    """What each hook registers as "bare": a component that declares no Config at all."""


class WrongPlugin:
    @staticmethod
    @hookimpl
    def register_models(register):
        register("wrong", Wrong)
        register("bare", Bare)

    @staticmethod
    @hookimpl
    def register_envs(register):
        register("wrong", Wrong)
        register("bare", Bare)

    @staticmethod
    @hookimpl
    def register_inference_backends(register):
        register("wrong", Wrong)
        register("bare", Bare)

    @staticmethod
    @hookimpl
    def register_launchers(register):
        register("wrong", Wrong)
        register("bare", Bare)

    @staticmethod
    @hookimpl
    def register_monitors(register):
        register("wrong", Wrong)
        register("bare", Bare)


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


@pytest.mark.parametrize("overrides,kind,base", [
    ([("model.name", "bare")], "model", "primerl.models.ModelConfig"),
    ([("env.name", "bare")], "env", "primerl.envs.EnvConfig"),
    ([("orchestrator.sources", '[{name = "b", env = "bare"}]')], "env", "primerl.envs.EnvConfig"),
    ([("inference.backend", "bare")], "inference_backend", "primerl.inference.InferenceConfig"),
    ([("launcher.name", "bare")], "launcher", "primerl.launchers.LauncherConfig"),
    ([("monitors.bare.enabled", "true")], "monitor", "primerl.monitors.MonitorConfig"),
], ids=["model", "env", "source-env", "inference", "launcher", "monitor"])
def test_a_plugin_that_declares_no_config_is_one_line_naming_the_line_to_add(registry, overrides, kind, base):
    """``Config`` is part of every such kind's contract: a plugin without it is refused when
    it is selected, naming the plugin and the class to set, never a traceback."""
    with pytest.raises(ConfigError) as exc:
        load_config(ConfigSources(overrides=overrides), {"model.name": "glm5"} if kind != "model" else None,
                    registry=registry)
    assert str(exc.value) == (f"{kind} plugin 'bare' ({__name__}:Bare) declares no Config: set Config = {base} on "
                              f"it (or a subclass with the plugin's own keys); fix the plugin")


def test_every_built_in_plugin_of_a_kind_with_a_section_declares_its_config():
    """The built-in models, envs, backends, launchers and monitors each set ``Config`` (the
    section's own class when they have no keys of their own)."""
    from primerl.envs import EnvConfig
    from primerl.inference import InferenceConfig
    from primerl.launchers import LauncherConfig
    from primerl.models import ModelConfig
    from primerl.monitors import MonitorConfig
    from primerl.registry import get_registry
    from primerl.sections import declared_config

    bases = {"model": ModelConfig, "env": EnvConfig, "inference_backend": InferenceConfig,
             "launcher": LauncherConfig, "monitor": MonitorConfig}
    reg = get_registry()
    checked = []
    for kind, base in bases.items():
        for c in reg.of_kind(kind):
            if c.error is None and c.distribution is not None and c.distribution.startswith("primerl"):
                assert issubclass(declared_config(c.load(), kind, c.name, base), base)
                checked.append(f"{kind}:{c.name}")
    assert {"launcher:local", "monitor:file", "inference_backend:embedded", "env:reverse-text"} <= set(checked)


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


# ---- run defaults meet the selected plugin's section ---------------------------------------


class Suggests(SingleTurnEnv):
    """An env that suggests keys for one backend and one launcher (kv_slots: the embedded
    engine's; nodes: the slurm launcher's) beside keys every plugin has."""

    run_defaults = {"inference": {"max_model_len": 300, "kv_slots": 8}, "launcher": {"nodes": 2},
                    "orchestrator": {"max_tokens": 12}}

    def tasks(self, split):
        return []

    def reward(self, task, completion):
        return 0.0


class Lean:
    """A backend with the shared keys only."""

    Config = InferenceConfig


class SuggestsPlugin:
    @staticmethod
    @hookimpl
    def register_envs(register):
        register("suggests", Suggests)

    @staticmethod
    @hookimpl
    def register_inference_backends(register):
        register("lean", Lean)


@pytest.fixture(scope="module")
def suggesting():
    return Registry.discover(extra=[SuggestsPlugin])


def test_run_defaults_a_selected_plugin_lacks_are_dropped_and_the_rest_apply(suggesting):
    """An env's run defaults are suggestions: under a backend (or launcher) whose Config lacks
    a key they set, that key is dropped with its origin, and the others still apply."""
    origins: dict[str, str] = {}
    cfg = load_config(ConfigSources(overrides=[("inference.backend", "lean")]), {"env.name": "suggests"},
                      registry=suggesting, origins=origins)
    assert type(cfg.inference) is InferenceConfig and type(cfg.launcher) is LauncherConfig
    assert cfg.inference.max_model_len == 300 and cfg.orchestrator.max_tokens == 12
    assert origins["inference.max_model_len"] == "the run defaults of env 'suggests'"
    assert "inference.kv_slots" not in origins and "launcher.nodes" not in origins
    # under the embedded backend the engine's key is its section's, and the suggestion holds
    cfg = load_config(ConfigSources(), {"env.name": "suggests"}, registry=suggesting)
    assert cfg.inference.kv_slots == 8 and cfg.inference.max_model_len == 300


@pytest.mark.parametrize("given", ["flag", "file"])
def test_the_same_key_given_by_the_user_is_an_error_naming_the_plugin_that_has_it(suggesting, tmp_path, given):
    if given == "flag":
        src, origin = ConfigSources(overrides=[("inference.backend", "lean"), ("inference.kv_slots", "16")]), \
            "the command line (--inference.kv_slots)"
    else:
        (tmp_path / "a.toml").write_text('[inference]\nbackend = "lean"\nkv_slots = 16\n')
        src, origin = ConfigSources(files=[str(tmp_path / "a.toml")]), f"'{tmp_path / 'a.toml'}'"
    with pytest.raises(ConfigError) as exc:
        load_config(src, {"env.name": "suggests"}, registry=suggesting)
    where = "the command line (--inference.backend)" if given == "flag" else origin
    assert str(exc.value) == (f"unknown key 'inference.kv_slots' (from {origin}): inference.backend 'lean' (from "
                              f"{where}) has no such key; it belongs to the section of inference_backend 'embedded' "
                              f"(drop it, or set inference.backend = 'embedded')")


def test_a_key_no_installed_plugin_has_stays_the_plain_unknown_key(suggesting):
    with pytest.raises(ConfigError, match=r"^unknown key 'inference.kv_slotz' \(from the command line "
                                          r"\(--inference.kv_slotz\)\). Did you mean 'kv_slots'\?"):
        load_config(ConfigSources(overrides=[("inference.kv_slotz", "16")]), registry=suggesting)


@pytest.mark.parametrize("env", ["reverse-text", "wordle", "alphabet-sort", "swe"])
def test_the_vllm_backend_loads_with_an_env_whose_run_defaults_size_the_embedded_engine(env):
    """The built-in envs size the embedded engine's KV cache (kv_slots) in their run
    defaults; with --inference.backend vllm that suggestion is dropped, not an error."""
    pytest.importorskip("primerl_vllm", reason="the vllm backend plugin is not installed: pip install -e "
                                               "plugins/inference/vllm")
    origins: dict[str, str] = {}
    try:
        cfg = load_config(ConfigSources(overrides=[("inference.backend", "vllm")]), {"env.name": env}, origins=origins)
    except ConfigError as exc:
        if "no env named" in str(exc):
            pytest.skip(f"the {env} env plugin is not installed")
        raise
    assert type(cfg.inference).__name__ == "VllmConfig" and "inference.kv_slots" not in origins
    assert origins["inference.max_model_len"] == f"the run defaults of env '{env}'"


def test_user_given_kv_slots_under_the_vllm_backend_exits_2_with_one_line(tmp_path):
    import importlib.util

    from conftest import run_cli

    if importlib.util.find_spec("primerl_vllm") is None:
        pytest.skip("the vllm backend plugin is not installed: pip install -e plugins/inference/vllm")
    r = run_cli("run", "--inference.backend", "vllm", "--inference.kv_slots", "16", "--output-dir",
                str(tmp_path / "o"), "--dry-run")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        "error: unknown key 'inference.kv_slots' (from the command line (--inference.kv_slots)): inference.backend "
        "'vllm' (from the command line (--inference.backend)) has no such key; it belongs to the section of "
        "inference_backend 'embedded' (drop it, or set inference.backend = 'embedded')"]
