"""The core finds what a plugin or model offers in its declarations (the kind's Protocol, its
capability record), not by probing attributes: the core holds at most ``MAX_PROBES`` calls of
``getattr``/``hasattr``, counted from the source with ``ast`` over every module. The ones left
are mechanisms, not capability probes: a lazy ``"module:attr"`` target, pluggy's hook markers
and a plugin object's name, a tool an env names and an env method a worker runs by
name, a type's name in an error, a dtype by its name, library feature checks (torch, DeepGEMM, an
HF config, a tokenizer's answer).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CORE = REPO / "core" / "primerl"
MAX_PROBES = 14


def probes(root: Path) -> list[str]:
    """``file:line`` of every ``getattr(...)``/``hasattr(...)`` call under ``root``."""
    out = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
                out.append(f"{path.relative_to(root.parent)}:{node.lineno}: {node.func.id}")
    return out


def test_the_core_holds_at_most_its_budget_of_getattr_and_hasattr():
    found = probes(CORE)
    assert len(found) <= MAX_PROBES, (
        f"{len(found)} getattr/hasattr calls in core (at most {MAX_PROBES}); declare the capability in the "
        f"kind's Protocol or capability record instead:\n" + "\n".join(found))


def test_the_count_sees_what_it_counts(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text("x = getattr(a, 'b', None)\nif hasattr(a, 'c'):\n    pass\nsetattr(a, 'd', 1)\n")
    assert probes(tmp_path / "pkg") == ["pkg/m.py:1: getattr", "pkg/m.py:2: hasattr"]
