"""Typed config: files merged left to right, CLI overrides last, errors that say where."""

import pytest

from primerl.config import ConfigSources, dump_toml, split_args, to_dict
from primerl.errors import ConfigError
from primerl.preflight import load_checked

pytestmark = pytest.mark.usefixtures("tmp_path")


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_split_args_accepts_both_file_forms_and_override_forms():
    src = split_args(["@", "a.toml", "@b.toml", "--trainer.lr", "3e-4", "--env.x=5", "--trainer.router_replay"])
    assert src.files == ["a.toml", "b.toml"]
    assert src.overrides == [("trainer.lr", "3e-4"), ("env.x", "5"), ("trainer.router_replay", "true")]


def test_files_merge_left_to_right_then_overrides(tmp_path):
    a = write(tmp_path, "a.toml", "max_steps = 5\n[trainer]\nlr = 0.1\nwarmup_steps = 3\n")
    b = write(tmp_path, "b.toml", "[trainer]\nlr = 0.2\n[orchestrator]\nasync_level = 2\n")
    cfg = load_checked(ConfigSources(files=[a, b], overrides=[("trainer.lr", "0.3")]))
    assert cfg.max_steps == 5
    assert cfg.trainer.lr == 0.3 and cfg.trainer.warmup_steps == 3
    assert cfg.orchestrator.async_level == 2


def test_plugin_section_is_validated_by_the_plugins_config_class(tmp_path):
    cfg = load_checked(ConfigSources(overrides=[("env.max_words", "3")]), {"env.name": "reverse-text"})
    assert type(cfg.env).__name__ == "ReverseTextConfig" and cfg.env.max_words == 3
    with pytest.raises(ConfigError, match="max_words"):
        load_checked(ConfigSources(overrides=[("env.max_words", "0")]))


def test_unknown_key_names_path_file_and_suggestion(tmp_path):
    a = write(tmp_path, "a.toml", "[trainer]\nlrr = 0.1\n")
    with pytest.raises(ConfigError) as err:
        load_checked(ConfigSources(files=[a]))
    msg = str(err.value)
    assert "trainer.lrr" in msg and "a.toml" in msg and "Did you mean 'lr'" in msg


def test_wrong_type_names_path_and_origin():
    with pytest.raises(ConfigError) as err:
        load_checked(ConfigSources(overrides=[("orchestrator.group_size", "eight")]))
    msg = str(err.value)
    assert "'orchestrator.group_size' must be an integer" in msg and "--orchestrator.group_size" in msg


def test_validator_errors_name_the_key():
    with pytest.raises(ConfigError, match="trainer.lr.*must be > 0"):
        load_checked(ConfigSources(overrides=[("trainer.lr", "-1")]))


def test_impossible_combinations_are_rejected():
    with pytest.raises(ConfigError, match="multiple of orchestrator.group_size"):
        load_checked(ConfigSources(overrides=[("orchestrator.batch_size", "10"), ("orchestrator.group_size", "4")]))
    with pytest.raises(ConfigError, match="async_level .* cannot exceed"):
        load_checked(ConfigSources(overrides=[("orchestrator.async_level", "3"),
                                             ("orchestrator.max_off_policy_steps", "2")]))

    with pytest.raises(ConfigError, match="trainer.precision = 'float32' with the fsdp strategy on CUDA.*--trainer.precision"):
        load_checked(ConfigSources(overrides=[("trainer.device", "cuda"), ("trainer.nproc", "2"),
                                             ("trainer.precision", "float32")]))
    auto = load_checked(ConfigSources(overrides=[("trainer.device", "cuda"), ("trainer.nproc", "2")])).trainer
    assert auto.resolved_precision() == "bfloat16"
    import torch

    on_this_machine = "bfloat16" if torch.cuda.is_available() else "float32"
    assert load_checked(ConfigSources()).trainer.resolved_precision() == on_this_machine


def test_unknown_plugin_is_a_config_error():
    with pytest.raises(ConfigError, match="no env named 'nope'"):
        load_checked(ConfigSources(), {"env.name": "nope"})


def test_bad_toml_and_missing_file(tmp_path):
    bad = write(tmp_path, "bad.toml", "[trainer\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_checked(ConfigSources(files=[bad]))
    with pytest.raises(ConfigError, match="does not exist"):
        load_checked(ConfigSources(files=[str(tmp_path / "missing.toml")]))


def test_resolved_config_round_trips_through_toml(tmp_path):
    cfg = load_checked(ConfigSources(overrides=[("trainer.lr", "0.5"), ("max_steps", "7")]))
    text = dump_toml(to_dict(cfg))
    again = load_checked(ConfigSources(files=[write(tmp_path, "resolved.toml", text)]))
    assert to_dict(again) == to_dict(cfg)


@pytest.mark.parametrize("key,kind", [("inference.router", "router"), ("inference.kv_store", "kv_store"),
                                      ("inference.backend", "inference_backend"), ("launcher.name", "launcher"),
                                      ("trainer.parallelism", "parallelism"), ("trainer.loss", "loss"),
                                      ("trainer.correction", "correction"), ("orchestrator.advantage", "advantage")])
def test_a_key_naming_a_plugin_that_is_not_installed_fails_at_once(key, kind):
    with pytest.raises(ConfigError, match=rf"{key} = 'nope' \(from the command line.*no {kind} named 'nope'"):
        load_checked(ConfigSources(overrides=[(key, "nope")]))


def test_a_loss_or_advantage_may_be_any_function_given_as_module_attr():
    cfg = load_checked(ConfigSources(overrides=[("orchestrator.advantage", "my_pkg.adv:rloo")]))
    assert cfg.orchestrator.advantage == "my_pkg.adv:rloo"  # imported by the process that uses it


@pytest.mark.parametrize("overrides, message", [
    ([("trainer.loss", "grpo_clip"), ("trainer.loss_options.clip_low", "1.5")],
     r"trainer.loss_options \(from the command line \(--trainer.loss_options.clip_low\)\) do not fit trainer.loss "
     r"'grpo_clip': clip_low must be in \[0, 1\)"),
    ([("trainer.loss", "gspo"), ("trainer.loss_options.clip", "0.1")],
     r"do not fit trainer.loss 'gspo': .*unexpected keyword argument 'clip'"),
    ([("trainer.correction", "mis"), ("trainer.correction_options.floor", "3")],
     r"trainer.correction_options .* do not fit trainer.correction 'mis': floor \(3.0\) must be below cap \(2.0\)"),
    ([("trainer.correction_options.cap", "3")], r"trainer.correction_options .* set, but trainer.correction names no "
                                                 r"component"),
    ([("orchestrator.advantage", "rloo"), ("orchestrator.advantage_options.beta", "1")],
     r"orchestrator.advantage_options .* do not fit orchestrator.advantage 'rloo'"),
    ([("trainer.kl_coef", "0.1")], r"unknown key 'trainer.kl_coef' .* It is now the default loss's "
                                   r"trainer.loss_options.kl_tau"),
    ([("orchestrator.overlong_buffer", "64"), ("orchestrator.max_tokens", "64")],
     r"orchestrator.overlong_buffer \(64, .*must be below orchestrator.max_tokens \(64\)"),
])
def test_an_algorithms_options_are_checked_by_the_component_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_checked(ConfigSources(overrides=overrides))


def test_a_sequence_level_loss_or_correction_is_refused_with_context_parallel():
    base = [("trainer.nproc", "2"), ("trainer.parallel.cp", "2")]
    with pytest.raises(ConfigError, match=r"trainer.loss = 'gspo' .* works on whole sequences, which context parallel"):
        load_checked(ConfigSources(overrides=[*base, ("trainer.loss", "gspo")]))
    with pytest.raises(ConfigError, match=r"trainer.correction = 'tis' .* works on whole sequences"):
        load_checked(ConfigSources(overrides=[*base, ("trainer.correction", "tis"),
                                             ("trainer.correction_options.level", "sequence")]))
    cfg = load_checked(ConfigSources(overrides=[*base, ("trainer.loss", "dapo"), ("trainer.correction", "tis")]))
    assert cfg.trainer.loss_options == {} and cfg.trainer.correction == "tis"


def test_inference_section_is_validated_by_the_selected_backends_config_class():
    """A backend with a Config (a subclass of InferenceConfig) owns [inference]: its keys are
    typed and checked like any section, and its check(run, sources) sees the whole run."""
    import attrs

    from primerl import hookimpl
    from primerl.inference import InferenceConfig
    from primerl.registry import Registry

    @attrs.define(kw_only=True)
    class FakeConfig(InferenceConfig):
        tensor_parallel_size: int = attrs.field(default=1)

        @tensor_parallel_size.validator
        def _tp(self, attribute, value):
            if value < 1:
                raise ValueError(f"{attribute.name}: must be >= 1, got {value}")

        def check(self, run, sources):
            if run.trainer.router_replay:
                raise ConfigError("trainer.router_replay: the fake backend cannot return routed experts")

    class FakeBackend:
        Config = FakeConfig

    class FakePlugin:
        @staticmethod
        @hookimpl
        def register_inference_backends(register):
            register("fake", FakeBackend)

    reg = Registry.discover(extra=[FakePlugin])
    fake = [("inference.backend", "fake")]
    cfg = load_checked(ConfigSources(overrides=[*fake, ("inference.tensor_parallel_size", "4")]), registry=reg)
    assert type(cfg.inference) is FakeConfig and cfg.inference.tensor_parallel_size == 4
    with pytest.raises(ConfigError, match=r"inference.tensor_parallel_size.*--inference.tensor_parallel_size.*>= 1"):
        load_checked(ConfigSources(overrides=[*fake, ("inference.tensor_parallel_size", "0")]), registry=reg)
    with pytest.raises(ConfigError, match="router_replay: the fake backend"):
        load_checked(ConfigSources(overrides=[*fake, ("trainer.router_replay", "true")]), registry=reg)
    # the default backend keeps the plain section: a backend's key is unknown there
    with pytest.raises(ConfigError, match="unknown key 'inference.tensor_parallel_size'"):
        load_checked(ConfigSources(overrides=[("inference.tensor_parallel_size", "4")]), registry=reg)
    text = dump_toml(to_dict(cfg))  # what the launcher writes for its processes reads back the same
    assert "tensor_parallel_size = 4" in text


def test_the_nccl_weight_channel_needs_a_backend_that_receives_it():
    with pytest.raises(ConfigError, match="inference.backend 'embedded' cannot receive"):
        load_checked(ConfigSources(overrides=[("trainer.weight_channel", "nccl")]))


def test_trainer_settings_the_model_does_not_support_are_refused_naming_the_key(tmp_path):
    """The model plugin's ModelCapabilities decide: Nemotron's Mamba-2 scan cannot be split
    over cp ranks, while its experts can be split over ep ranks."""
    nemotron = [("model.name", "nemotron"), ("trainer.nproc", "2")]
    with pytest.raises(ConfigError) as e:
        load_checked(ConfigSources(overrides=[*nemotron, ("trainer.parallel.cp", "2")]))
    assert str(e.value) == ("trainer.parallel.cp (from the command line (--trainer.parallel.cp)): model 'nemotron' (preset 'tiny') does not "
                            "support context parallel: set it to 1")
    assert load_checked(ConfigSources(overrides=[*nemotron, ("trainer.parallel.ep", "2")])).trainer.parallel.ep == 2
    # a checkpoint of another architecture than --model's is named in one line at config time
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ConfigError, match=r"^model.checkpoint \(.*--model.checkpoint\)\): .*config.json is a 'llama' "
                                          r"model, not glm_moe_dsa$"):
        load_checked(ConfigSources(overrides=[("model.name", "glm5"), ("model.checkpoint", str(tmp_path / "ckpt"))]))
    # without --model, the plugin made for the checkpoint's model_type runs it
    assert load_checked(ConfigSources(overrides=[("model.checkpoint", str(tmp_path / "ckpt"))])).model.name == "llama"


def test_a_checkpoint_without_moe_layers_has_no_experts_to_split_or_replay(tmp_path):
    import json

    from primerl.models import ModelConfig
    from primerl.registry import get_registry

    adapter = get_registry().load("model", "qwen3-moe")()
    caps = adapter.capabilities(ModelConfig(name="qwen3-moe"))
    assert caps.expert_parallel and caps.router_replay and caps.context_parallel
    hf = adapter.hf_config("tiny")
    (tmp_path / "config.json").write_text(json.dumps(hf | {"mlp_only_layers": list(range(hf["num_hidden_layers"]))}))
    caps = adapter.capabilities(ModelConfig(name="qwen3-moe", checkpoint=str(tmp_path)))
    assert not caps.expert_parallel and not caps.router_replay and caps.context_parallel
    with pytest.raises(ConfigError, match=r"^trainer.router_replay .*model 'qwen3-moe' \(checkpoint .*\) does not "
                                          r"support router replay: leave it off$"):
        load_checked(ConfigSources(overrides=[("model.name", "qwen3-moe"), ("model.checkpoint", str(tmp_path)),
                                             ("trainer.router_replay", "true")]))


def test_router_options_must_fit_the_routers_constructor():
    cfg = load_checked(ConfigSources(overrides=[("inference.router", "sticky"),
                                               ("inference.router_options", "{poll_s = 2}")]))
    assert cfg.inference.router_options == {"poll_s": 2}
    with pytest.raises(ConfigError, match=r"inference.router_options \(from the command line.*do not fit router "
                                          r"'sticky': .*'poll'.*router 'sticky' takes: .*poll_s"):
        load_checked(ConfigSources(overrides=[("inference.router", "sticky"), ("inference.router_options", "{poll = 2}")]))


def test_kv_store_options_reach_the_stores_constructor_and_are_checked():
    cfg = load_checked(ConfigSources(overrides=[("inference.kv_store", "disk"),
                                               ("inference.kv_store_options", "{block_size = 32}")]))
    assert cfg.inference.kv_store_options == {"block_size": 32}
    with pytest.raises(ConfigError, match=r"inference.kv_store_options .*kv_store 'disk' takes: root"):
        load_checked(ConfigSources(overrides=[("inference.kv_store", "disk"), ("inference.kv_store_options", "{size = 1}")]))
