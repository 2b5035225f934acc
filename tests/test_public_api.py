"""Plugins code against the public API (``primerl.api.PUBLIC_MODULES``) and nothing else.

Read from the source with ``ast``: every ``import`` and ``from ... import`` of a core module in
a built-in plugin's ``.py`` files (and the examples') names a public module, and every name it takes from one (or
reads off one imported whole, ``inference.server_socket``) is in that module's ``__all__``.
Every public module declares ``__all__``, and ``docs/plugins.md`` names every public module.
"""

from __future__ import annotations

import ast
from pathlib import Path

from primerl.api import PUBLIC_MODULES

REPO = Path(__file__).resolve().parents[1]
CORE = REPO / "core"
PLUGINS = REPO / "plugins"
EXAMPLES = REPO / "examples"  # the plugin template and the example env plugins, copied by authors


def module_path(module: str, core: Path = CORE) -> Path | None:
    """The file of core module ``module`` (a package: its ``__init__.py``); None: not a core module."""
    base = core.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def declared_all(path: Path) -> tuple[str, ...] | None:
    """The names ``__all__`` lists at the top of ``path``; None: it declares none."""
    for node in ast.parse(path.read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets) and node.value is not None:
            return tuple(ast.literal_eval(node.value))
    return None


def public_names(module: str, core: Path = CORE) -> tuple[str, ...]:
    path = module_path(module, core)
    return (declared_all(path) if path else None) or ()


def _core(module: str) -> bool:
    return module == "primerl" or module.startswith("primerl.")


def violations(path: Path, public: tuple[str, ...] = PUBLIC_MODULES, core: Path = CORE) -> list[str]:
    """``file:line: why`` for every import in ``path`` of a core module outside ``public`` or of
    a name outside its module's ``__all__``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out: list[str] = []
    whole: dict[str, str] = {}  # local name -> public module imported whole

    def check_module(line: int, module: str) -> bool:
        if module not in public:
            out.append(f"{path}:{line}: imports {module}, which is not public (primerl.api.PUBLIC_MODULES)")
            return False
        return True

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _core(alias.name) and check_module(node.lineno, alias.name) and alias.asname:
                    whole[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and _core(node.module):
            if not check_module(node.lineno, node.module):
                continue
            exported = public_names(node.module, core)
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                if module_path(submodule, core) is not None and submodule not in exported:
                    if check_module(node.lineno, submodule):
                        whole[alias.asname or alias.name] = submodule
                elif alias.name not in exported:
                    out.append(f"{path}:{node.lineno}: imports {alias.name} from {node.module}, "
                               f"which is not in its __all__")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in whole:
            module = whole[node.value.id]
            if node.attr not in public_names(module, core) and module_path(f"{module}.{node.attr}", core) is None:
                out.append(f"{path}:{node.lineno}: reads {node.attr} off {module}, which is not in its __all__")
    return out


def test_every_public_module_exists_and_declares_all():
    missing = [m for m in PUBLIC_MODULES if module_path(m) is None]
    assert not missing, f"public modules that are not in core: {missing}"
    lacking = [m for m in PUBLIC_MODULES if declared_all(module_path(m)) is None]
    assert not lacking, f"public modules without __all__: {lacking}"


def test_every_name_in_all_is_defined():
    import importlib

    undefined = [f"{m}.{n}" for m in PUBLIC_MODULES if declared_all(module_path(m))
                 for n in declared_all(module_path(m)) if not hasattr(importlib.import_module(m), n)
                 and module_path(f"{m}.{n}") is None]
    assert not undefined, f"names in __all__ that the module does not define: {undefined}"


def test_built_in_plugins_import_only_the_public_api():
    paths = sorted(PLUGINS.rglob("*.py")) + sorted(EXAMPLES.rglob("*.py"))
    assert len(paths) > 100
    bad = [v for path in paths for v in violations(path)]
    assert not bad, "built-in plugins import core internals:\n" + "\n".join(bad)


def test_docs_name_every_public_module():
    text = (REPO / "docs" / "plugins.md").read_text()
    unnamed = [m for m in PUBLIC_MODULES if f"`{m}`" not in text]
    assert not unnamed, f"docs/plugins.md does not name the public modules {unnamed}"


def test_the_check_sees_what_it_checks(tmp_path):
    core = tmp_path / "core"
    (core / "primerl").mkdir(parents=True)
    (core / "primerl" / "__init__.py").write_text('__all__ = ["hookimpl"]\n')
    (core / "primerl" / "pub.py").write_text('__all__ = ["Open"]\n')
    (core / "primerl" / "inner.py").write_text("X = 1\n")
    plugin = tmp_path / "plugin.py"
    plugin.write_text("from primerl import hookimpl, pub\n"
                      "from primerl.pub import Open, Hidden\n"
                      "from primerl.inner import X\n"
                      "import primerl.inner\n"
                      "pub.Open, pub.Secret\n")
    found = violations(plugin, ("primerl", "primerl.pub"), core)
    assert found == [f"{plugin}:2: imports Hidden from primerl.pub, which is not in its __all__",
                     f"{plugin}:3: imports primerl.inner, which is not public (primerl.api.PUBLIC_MODULES)",
                     f"{plugin}:4: imports primerl.inner, which is not public (primerl.api.PUBLIC_MODULES)",
                     f"{plugin}:5: reads Secret off primerl.pub, which is not in its __all__"], found
