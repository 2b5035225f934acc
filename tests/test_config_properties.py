"""Property-based tests of the config loader: whatever keys and values a user writes, on the
command line or in a TOML file, loading ends in a config or in a ConfigError (one line
naming the problem), never in another exception."""

from __future__ import annotations

import attrs
from hypothesis import example, given, settings
from hypothesis import strategies as st

from primerl import config
from primerl.config import ConfigSources, load_config
from primerl.errors import PrimerlError


def _keys() -> list[str]:
    keys = []
    for section in attrs.fields(config.RunConfig):
        if attrs.has(section.type) or (isinstance(section.type, str) and section.type.endswith("Config")):
            cls = getattr(config, section.type, None) if isinstance(section.type, str) else section.type
            for f in attrs.fields(cls) if cls is not None and attrs.has(cls) else ():
                keys.append(f"{section.name}.{f.name}")
        else:
            keys.append(section.name)
    return keys + ["trainer.parallel.ep", "trainer.parallel.dp_shard", "nonsense.key", "trainer.nonsense"]


VALUES = st.one_of(st.integers(-10**6, 10**6).map(str), st.floats(allow_nan=True).map(str),
                   st.sampled_from(["true", "false", "", "auto", "cpu", "[1, 2]", "{a = 1}", "-1", "0", "glm5"]),
                   st.text(max_size=12))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(_keys()), VALUES), max_size=4))
@example([("inference.router", "\n")])  # a plugin name with a newline: the message quotes it (repr)
@example([("model.name", "a\nb")])
def test_any_overrides_load_or_fail_with_a_config_error(overrides):
    try:
        load_config(ConfigSources(overrides=overrides))
    except PrimerlError as exc:
        assert str(exc) and "\n" not in str(exc).strip(), str(exc)


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=200))
def test_any_toml_file_loads_or_fails_with_a_config_error(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("toml") / "run.toml"
    path.write_text(text)
    try:
        load_config(ConfigSources(files=[str(path)]))
    except PrimerlError as exc:
        assert str(exc)
