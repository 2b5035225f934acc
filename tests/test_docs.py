"""Docs stay true: every hook is documented with its signature and an example, and the
configuration reference is the generated one, with every key described."""

import re

import attrs
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


def test_configuration_reference_is_generated_and_described():
    from primerl import config_reference

    fix = "regenerate it: python -m primerl.config_reference > docs/configuration.md"
    text = (REPO / "docs" / "configuration.md").read_text()
    assert text == config_reference.render(), f"docs/configuration.md is not the generated reference; {fix}"
    for section in config_reference.sections():
        for row in section.rows:
            where = f"{section.path or 'the top level'}.{row.key}"
            assert row.description.strip(), (
                f"{where} has no description: give its field a comment in {section.cls.__module__} "
                f"(above it or inline), then {fix}")
    paths = [s.path for s in config_reference.sections()]
    assert paths.index("trainer.parallel") == paths.index("trainer") + 1


@attrs.define
class _Commented:
    # above,
    # on two lines
    a: str = "x # not a comment"  # and inline
    b: int = 0

    c: int = attrs.field(
        default=1,  # in the call
    )


def test_config_reference_reads_comments_not_strings():
    from primerl.config_reference import field_comments

    assert field_comments(_Commented) == {"a": "above, on two lines and inline", "c": "in the call"}


def _members(cls) -> set[str]:
    """The public members a kind's Protocol or base class declares (methods, properties,
    annotated attributes), its own and its bases' within primerl."""
    out = set()
    for klass in cls.__mro__:
        if klass is object or not klass.__module__.startswith("primerl"):
            continue
        out |= {n for n in vars(klass) if not n.startswith("_")}
        out |= {n for n in getattr(klass, "__annotations__", {}) if not n.startswith("_")}
    return out


def _kinds():
    from primerl.envs import CheckableEnv, Environment, PreparableEnv
    from primerl.inference import InferenceBackend, WeightSender
    from primerl.kv_stores import KVStore, ReportsEvictions
    from primerl.launchers import Launcher
    from primerl.models import ModelAdapter
    from primerl.monitors import Monitor, MonitorCapabilities, MonitorConfig
    from primerl.parallel import Parallelism
    from primerl.routers import Router

    return {"register_models": [ModelAdapter], "register_envs": [Environment, CheckableEnv, PreparableEnv],
            "register_routers": [Router], "register_kv_stores": [KVStore, ReportsEvictions],
            "register_parallelisms": [Parallelism], "register_inference_backends": [InferenceBackend, WeightSender],
            "register_launchers": [Launcher], "register_monitors": [Monitor, MonitorConfig, MonitorCapabilities]}


def test_every_member_of_a_kinds_protocol_is_documented_in_its_section():
    """docs/plugins.md names, in the hook's section, every member the kind's Protocol (or base
    class) declares: what the core relies on is what a plugin author reads."""
    text = (REPO / "docs" / "plugins.md").read_text()
    missing = {}
    for hook, classes in _kinds().items():
        section = text.split(f"### `{hook}(register)`", 1)[1].split("\n### ", 1)[0]
        for cls in classes:
            names = sorted(m for m in _members(cls) if not re.search(rf"`{m}\b", section))
            if names:
                missing[f"{hook}: {cls.__name__}"] = names
    assert missing == {}


def test_every_algorithm_has_a_section_in_the_algorithms_page_and_no_section_is_stale():
    """docs/algorithms.md's sections are exactly the registered losses, corrections and
    advantages (every plugin installed here: the core's own and any other)."""
    from primerl.registry import get_registry

    text = (REPO / "docs" / "algorithms.md").read_text()
    chapters = {"loss": "## Losses", "correction": "## Off-policy corrections", "advantage": "## Advantages"}
    reg = get_registry()
    for kind, title in chapters.items():
        chapter = text.split(title, 1)[1].split("\n## ", 1)[0]
        documented = set(re.findall(r"^### `([a-z_0-9]+)`$", chapter, re.M))
        assert documented == {c.name for c in reg.of_kind(kind)}, kind
