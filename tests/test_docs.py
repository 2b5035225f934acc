"""Docs stay true: every hook is documented with its signature and an example."""

import re

from conftest import REPO

import primerl.hookspecs as hookspecs


def test_every_hook_is_documented():
    text = (REPO / "docs" / "plugins.md").read_text()
    hooks = [n for n in dir(hookspecs) if n.startswith("register_")]
    for hook in hooks:
        assert f"### `{hook}(register)`" in text, f"docs/plugins.md lacks a section for {hook}"
        section = text.split(f"### `{hook}(register)`", 1)[1].split("\n### ", 1)[0]
        assert f"def {hook}(register)" in section, f"{hook} section has no example"


def test_quick_start_has_two_lines_and_ci_runs_the_test_line():
    readme = (REPO / "README.md").read_text()
    block = re.search(r"#+ Quick start\n+```[a-z]*\n(.*?)```", readme, re.S).group(1)
    lines = [ln for ln in block.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert len(lines) == 2
    assert "primerl run --model glm5 --env reverse-text" in lines[0]
    test_cmd = lines[1].split("&&")[-1].strip()
    assert test_cmd in (REPO / ".ci" / "run").read_text()


def test_every_core_config_key_is_in_the_reference():
    import attrs

    from primerl import config

    text = (REPO / "docs" / "configuration.md").read_text()
    for cls in (config.RunConfig, config.InferenceConfig, config.OrchestratorConfig, config.TrainerConfig,
                config.SftConfig, config.LauncherConfig):
        for f in attrs.fields(cls):
            if not attrs.has(f.type) and not (isinstance(f.type, str) and f.type.endswith("Config")):
                assert f"| `{f.name}` |" in text, f"docs/configuration.md lacks {cls.__name__}.{f.name}"
