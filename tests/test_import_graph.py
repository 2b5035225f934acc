"""The core's module graph, read from the source: no import circle, no module too long to read
(and no function in core or the built-in plugins longer than 80 lines).

Every import a module runs counts, at the top or inside a function (a function-local import
hides a circle from Python's import machinery, not from a reader). Imports under
``if TYPE_CHECKING:`` count not: they never run, and they are how a contract names the
composed ``RunConfig`` in its signatures. An import names the module it reads a name from
(``from primerl.models import sources`` names ``primerl.models.sources``, a submodule).
Layers import downward: the leaves (errors, validators, structuring), the contracts with
their config sections, the registry, the config that composes the sections, the preflight
that builds components to check them, the runtime roles, the CLI.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CORE = REPO / "core" / "primerl"
MAX_LINES = 800
MAX_FUNCTION_LINES = 80


def module_name(path: Path, root: Path) -> str:
    """``primerl.models.sources`` for ``<root>/primerl/models/sources.py`` (a package: its folder)."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(tree: ast.AST) -> set[int]:
    """The ids of the nodes under ``if TYPE_CHECKING:`` (never run)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(inner) for stmt in node.body for inner in ast.walk(stmt)}
    return skip


def imported_modules(path: Path, name: str, modules: set[str]) -> list[tuple[int, str]]:
    """(line, module of ``modules``) for every import ``path`` (module ``name``) runs."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = _type_checking_only(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # primerl.models.sources.packaged -> primerl.models.sources
                target = target.rpartition(".")[0]
            if target and target != name:
                out.append((node.lineno, target))
    return out


def import_graph(root: Path) -> dict[str, list[tuple[int, str]]]:
    """Module -> the (line, module) it imports, over the package at ``root``."""
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    return {name: imported_modules(path, name, set(files)) for name, path in files.items()}


def find_cycle(graph: dict[str, list[tuple[int, str]]]) -> list[str]:
    """One import circle as ``a:line -> b`` steps (empty: none), found depth first."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[tuple[str, int]] = []

    def visit(module: str) -> list[str]:
        state[module] = 1
        for line, target in graph.get(module, []):
            path.append((module, line))
            if state.get(target) == 1:
                start = next(i for i, (m, _) in enumerate(path) if m == target)
                loop = path[start:]
                return [f"{m}:{ln} -> {loop[i + 1][0] if i + 1 < len(loop) else target}"
                        for i, (m, ln) in enumerate(loop)]
            if target not in state and (found := visit(target)):
                return found
            path.pop()
        state[module] = 2
        return []

    for module in sorted(graph):
        if module not in state and (found := visit(module)):
            return found
    return []


def reachable(graph: dict[str, list[tuple[int, str]]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for _, target in graph.get(todo.pop(), []):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def test_no_import_circle_among_core_modules():
    graph = import_graph(CORE)
    assert len(graph) > 50 and sum(map(len, graph.values())) > 100  # it read the tree
    assert find_cycle(graph) == [], "an import circle in core (function-local imports count)"


def test_no_core_module_is_longer_than_800_lines():
    long = {str(p.relative_to(REPO)): n for p in sorted(CORE.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"split these by concern (at most {MAX_LINES} lines a module)"


def test_no_function_in_core_or_the_built_in_plugins_is_longer_than_80_lines():
    """A function that mixes concerns shows as length first: split where it does."""
    long = []
    for path in sorted([*CORE.rglob("*.py"), *(REPO / "plugins").rglob("*.py")]):
        if ".venv" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                    (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
                long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({n} lines)")
    assert long == [], f"split these (at most {MAX_FUNCTION_LINES} lines a function)"


def test_loading_the_config_imports_no_component_builder():
    """``primerl.config`` composes sections and loads files and flags; building the loss,
    corrections and advantages to check them is the preflight's, above it."""
    graph = import_graph(CORE)
    below = reachable(graph, "primerl.config")
    assert "primerl.registry" in below and "primerl.envs" in below
    assert not {m for m in below if m == "primerl.algorithms" or m.startswith("primerl.algorithms.")}
    assert "primerl.preflight" not in below
    assert "primerl.algorithms" in reachable(graph, "primerl.preflight")


def test_each_contract_owns_its_config_section():
    from primerl.config import RunConfig
    from primerl.envs import EnvConfig
    from primerl.inference import InferenceConfig
    from primerl.launchers import LauncherConfig
    from primerl.models import ModelConfig
    from primerl.parallel import ParallelConfig

    owners = {EnvConfig: "primerl.envs", InferenceConfig: "primerl.inference", LauncherConfig: "primerl.launchers",
              ModelConfig: "primerl.models", ParallelConfig: "primerl.parallel"}
    assert {cls: cls.__module__ for cls in owners} == owners
    run = RunConfig()
    assert (type(run.env), type(run.inference), type(run.launcher), type(run.model),
            type(run.trainer.parallel)) == (EnvConfig, InferenceConfig, LauncherConfig, ModelConfig, ParallelConfig)


OWNED = {"EnvConfig": "primerl.envs", "InferenceConfig": "primerl.inference", "LauncherConfig": "primerl.launchers",
         "ModelConfig": "primerl.models", "MonitorConfig": "primerl.monitors", "ParallelConfig": "primerl.parallel"}


def test_section_classes_are_imported_from_their_owners():
    """Core, plugins, tests and benches import a contract's section class from the contract,
    never through a module that happens to hold the name (``primerl.config``)."""
    paths = [p for top in ("core", "plugins", "tests", "bench", "examples") for p in sorted((REPO / top).rglob("*.py"))]
    wrong = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                wrong += [f"{path.relative_to(REPO)}:{node.lineno} {a.name} from {node.module}" for a in node.names
                          if a.name in OWNED and node.module != OWNED[a.name]]
    assert wrong == []


def test_the_graph_sees_what_it_checks(tmp_path):
    """A circle closed by a function-local or relative import is found, naming each step; one
    through ``if TYPE_CHECKING:`` is not; a long module would be reported."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from .c import g\n")
    (pkg / "c.py").write_text("import os\n\n\ndef g():\n    import pkg.a\n")
    (pkg / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import e\n")
    (pkg / "e.py").write_text("from pkg.d import TYPE_CHECKING\n")
    graph = import_graph(pkg)
    assert graph["pkg.b"] == [(2, "pkg.c")] and graph["pkg.d"] == []
    assert find_cycle(graph) == ["pkg.a:1 -> pkg.b", "pkg.b:2 -> pkg.c", "pkg.c:5 -> pkg.a"]
    (pkg / "c.py").write_text("import os\n")
    assert find_cycle(import_graph(pkg)) == []
