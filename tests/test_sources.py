"""[[orchestrator.sources]]: several environments in one run, each checked by its own env's
Config, mixed by ratio into every batch."""

import pytest

from primerl.config import ConfigSources, dump_toml, load_config, to_dict
from primerl.errors import ConfigError


def load(tmp_path, text, *overrides):
    path = tmp_path / "run.toml"
    path.write_text(text)
    return load_config(ConfigSources(files=[str(path)], overrides=list(overrides)))


MIXED = """
[orchestrator]
batch_size = 64
group_size = 8
[[orchestrator.sources]]
name = "reverse"
env = {name = "reverse-text"}
ratio = 3
[[orchestrator.sources]]
name = "wordle"
env = {name = "wordle", max_turns = 4}
advantage = "grpo"
group_size = 4
[[orchestrator.eval_sources]]
name = "wordle-eval"
env = "wordle"
every = 5
"""


def test_sources_are_typed_by_their_envs_and_split_every_batch_by_ratio(tmp_path):
    cfg = load(tmp_path, MIXED)
    reverse, wordle = cfg.orchestrator.train_sources(cfg.env)
    assert (reverse.name, reverse.env.name, reverse.group_size, reverse.advantage) == (
        "reverse", "reverse-text", 8, "grpo_std")  # reverse-text's run defaults: its advantage
    assert (wordle.env.max_turns, wordle.group_size, wordle.advantage) == (4, 4, "grpo")
    assert cfg.orchestrator.groups_per_batch(cfg.env) == {"reverse": 6, "wordle": 4}  # 48 + 16 samples
    assert cfg.env.name == "reverse-text"  # the first source's env is the run's [env] (SFT, run defaults)
    (ev,) = cfg.orchestrator.eval_sources
    assert (ev.env.name, ev.every, ev.split) == ("wordle", 5, "eval")
    # the config file a launcher writes for its processes reads back the same
    again = tmp_path / "again"
    again.mkdir()
    assert to_dict(load(again, dump_toml(to_dict(cfg)))) == to_dict(cfg)


def test_one_env_is_the_short_form_of_one_source(tmp_path):
    cfg = load_config(ConfigSources(overrides=[("env.name", "wordle")]))
    (only,) = cfg.orchestrator.train_sources(cfg.env)
    assert only.name == "wordle" and only.env is cfg.env and only.group_size == cfg.orchestrator.group_size
    assert cfg.orchestrator.groups_per_batch(cfg.env) == {"wordle": cfg.orchestrator.batch_size // only.group_size}


@pytest.mark.parametrize("text,overrides,fragment", [
    (MIXED, [("env.name", "wordle")], "[env] (from the command line (--env.name)) and [[orchestrator.sources]] both"),
    (MIXED, [("orchestrator.batch_size", "60")], "split orchestrator.batch_size (60) into reverse: 6 groups of 8, "
                                                 "wordle: 4 groups of 4 = 64 samples"),
    (MIXED.replace("max_turns = 4", "max_turnz = 4"), [], "unknown key 'orchestrator.sources[1].env.max_turnz'"),
    (MIXED.replace('name = "wordle"\nenv', 'name = "reverse"\nenv'), [], "names ['reverse', 'reverse'] repeat"),
    (MIXED.replace('env = {name = "reverse-text"}', 'env = {name = "no-such-env"}'), [],
     "orchestrator.sources[0].env.name = 'no-such-env'"),
    (MIXED.replace('name = "reverse"', 'name = "re verse"'), [], "'re verse' must be letters, digits"),
])
def test_bad_sources_are_one_line_naming_the_key(tmp_path, text, overrides, fragment):
    with pytest.raises(ConfigError) as info:
        load(tmp_path, text, *overrides)
    assert fragment in str(info.value)
