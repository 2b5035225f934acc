"""The tree's seams, checked on the source: roles import only downward and no built-in plugin
imports another plugin's package.

Roles are the processes of a run: the orchestrator (``primerl.orchestrator``), the trainer
(``primerl.trainer``) and inference (the inference backend plugins). What two of them share
lives below them in the core (``primerl.inference``, ``primerl.models``, ``primerl.serving``,
``primerl.advantages``, ...), never in one of them. Plugins share through the core too: a
plugin imports ``primerl`` and its own package, nothing of another plugin.
"""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CORE = REPO / "core" / "primerl"
PLUGINS = REPO / "plugins"


def imports(path: Path) -> list[tuple[int, str]]:
    """Every absolute import of a file (inside functions too): (line, module)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
    return out


def plugin_packages() -> dict[str, Path]:
    """Every built-in plugin's top-level package: name -> folder."""
    return {p.name: p for p in sorted(PLUGINS.glob("*/*/primerl_*")) if p.is_dir()}


def test_roles_import_only_downward():
    inference = [name for name, path in plugin_packages().items() if path.parent.parent.name == "inference"]
    roles = {"orchestrator": ["primerl.orchestrator"], "trainer": ["primerl.trainer"],
             "inference": inference}
    files = {"orchestrator": sorted((CORE / "orchestrator").rglob("*.py")),
             "trainer": sorted((CORE / "trainer").rglob("*.py")),
             "inference": sorted(f for name in inference for f in plugin_packages()[name].rglob("*.py"))}
    assert files["orchestrator"] and files["trainer"] and len(inference) >= 2
    wrong = []
    for role, paths in files.items():
        others = [m for r, mods in roles.items() if r != role for m in mods]
        for path in paths:
            for line, module in imports(path):
                if any(module == o or module.startswith(o + ".") for o in others):
                    wrong.append(f"{path.relative_to(REPO)}:{line} ({role}) imports {module}")
    assert wrong == []


def test_no_built_in_plugin_imports_another_plugins_package():
    packages = plugin_packages()
    assert len(packages) >= 20
    wrong = []
    for name, folder in packages.items():
        for path in sorted(folder.rglob("*.py")):
            for line, module in imports(path):
                top = module.split(".")[0]
                if top in packages and top != name:
                    wrong.append(f"{path.relative_to(REPO)}:{line} imports {module}")
    assert wrong == []


def test_the_check_sees_what_it_checks(tmp_path):
    """The scanner reads imports inside functions and from-imports alike (else the tests above
    could pass on a tree full of violations)."""
    f = tmp_path / "m.py"
    f.write_text("import primerl_a\nfrom primerl.trainer import loss\n\ndef f():\n    from primerl_b.x import y\n")
    assert imports(f) == [(1, "primerl_a"), (2, "primerl.trainer"), (5, "primerl_b.x")]
