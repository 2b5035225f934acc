"""The configuration reference, ``docs/configuration.md``, generated from the config classes.

    python -m primerl.config_reference > docs/configuration.md

One table per section (key | type | default | description), in the order below; a nested
section (``trainer.parallel``) gets its own table right after its parent's, and so does a
table of named sections (``monitors: dict[str, MonitorConfig]``: ``[monitors.<name>]``). Types and
defaults come from the attrs fields; a description is the source comment of its field: the
comment lines directly above it and/or its inline ``# ...`` comment, joined into one line.
Comments are found with :mod:`tokenize` and fields with :mod:`ast`, so a ``#`` inside a
string is never taken for one. ``tests/test_docs.py`` checks that the file is this output
and that every key has a description. Light: imports no torch.
"""

from __future__ import annotations

import ast
import inspect
import io
import re
import sys
import textwrap
import tokenize
import types
import typing
from collections.abc import Iterator
from typing import Any, Literal, Union

import attrs

INTRO = """\
# Configuration reference

A run is configured by TOML files merged left to right (`@ a.toml @ b.toml`) and then
`--section.key value` overrides; `primerl run ... --dry-run` prints the resolved result.
A nested section such as `[trainer.parallel]` is a TOML table of its own (`[trainer.parallel]`
then `ep = 2`) or a flag with the whole path (`--trainer.parallel.ep 2`).
An environment may supply `run_defaults` that sit below every file and flag (reverse-text
does, so that the quick start learns on a CPU). Plugin sections (`[model]`, `[env]`) are
validated by the selected plugin's own `Config` class and may have more keys than listed here;
so is `[inference]` by the backend's (the embedded engine's own keys have a table below;
vLLM's: `docs/vllm.md`), and each `[monitors.<name>]` table by its monitor's (their keys:
`docs/monitors.md`). Keys an env's `run_defaults` set that the selected plugin's `Config`
lacks are dropped (the env suggested them for another backend); given in a file or a flag,
they are errors.

This file is generated from the config classes and their source comments
(`core/primerl/config.py` and the contract modules that own theirs: `ModelConfig` in
`core/primerl/models/__init__.py`, `EnvConfig` in `core/primerl/envs/__init__.py`, `InferenceConfig` in
`core/primerl/inference.py`, `ParallelConfig` in `core/primerl/parallel.py`, `LauncherConfig` in
`core/primerl/launchers.py`, `MonitorConfig` in `core/primerl/monitors.py`; the embedded
engine's keys in `plugins/inference/embedded/primerl_embedded/config.py`):
after changing a key, run `python -m primerl.config_reference > docs/configuration.md`.
"""

# RunConfig's sections in the order of the reference; one missing here follows them
ORDER = ("model", "env", "inference", "orchestrator", "trainer", "sft", "launcher", "monitors")
# plugin sections whose default plugin's own keys (its Config's fields beyond the section
# class's) get a table after the section's: the embedded engine's, what a default run sets
DEFAULT_PLUGIN_KEYS = ("inference",)
# what a heading adds for the sections that plugins extend
NOTES = {
    "model": "base of every model plugin's config",
    "env": "base of every environment's config",
    "monitors.<name>": "base of every monitor's options",
}


@attrs.frozen
class Row:
    key: str
    type: str
    default: str
    description: str


@attrs.frozen
class Section:
    path: str  # "" for the top level, else the dotted section ("trainer.parallel")
    cls: type
    rows: tuple[Row, ...]
    title: str = ""  # the heading, when it is not the path's

    @property
    def heading(self) -> str:
        if self.title:
            return self.title
        if not self.path:
            return "top level"
        note = NOTES.get(self.path)
        return f"`[{self.path}]`" + (f" ({note})" if note else "")


# --------------------------------------------------------------------------------------
# Descriptions: source comments of the fields
# --------------------------------------------------------------------------------------


def _class_comments(cls: type) -> dict[str, str]:
    """Field name -> its comment, for the fields defined in ``cls``'s own body."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    lines = source.splitlines()
    comments: dict[int, str] = {}  # 1-based line -> comment text
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()

    def comment_only(line: int) -> bool:
        return line in comments and lines[line - 1].lstrip().startswith("#")

    body = ast.parse(source).body[0]
    out: dict[str, str] = {}
    for node in body.body if isinstance(body, ast.ClassDef) else []:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above: list[str] = []
        line = node.lineno - 1
        while line >= 1 and comment_only(line):
            above.insert(0, comments[line])
            line -= 1
        inline = [comments[n] for n in range(node.lineno, (node.end_lineno or node.lineno) + 1)
                  if n in comments and not comment_only(n)]
        out[node.target.id] = " ".join(part for part in [*above, *inline] if part)
    return out


def field_comments(cls: type) -> dict[str, str]:
    """Field name -> description for every field of ``cls``, inherited ones included (a
    subclass's own comment wins)."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if attrs.has(klass):
            out.update({k: v for k, v in _class_comments(klass).items() if v})
    return out


# --------------------------------------------------------------------------------------
# Types and defaults
# --------------------------------------------------------------------------------------


def type_name(tp: Any) -> str:
    """A type as the reference writes it (no ``|``, which would split a table cell)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is type(None):
        return "None"
    if origin in (Union, types.UnionType):
        return " or ".join(type_name(a) for a in args)
    if origin is Literal:
        return "Literal[" + ", ".join(repr(a) for a in args) + "]"
    if origin is not None and args:
        return f"{origin.__name__ if isinstance(origin, type) else origin}[{', '.join(type_name(a) for a in args)}]"
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def default_text(field: attrs.Attribute) -> str:
    default = field.default
    if default is attrs.NOTHING:
        return "required"
    if isinstance(default, attrs.Factory):
        if default.takes_self:
            return "computed"
        default = default.factory()
    return repr(default)


# --------------------------------------------------------------------------------------
# Sections and the file
# --------------------------------------------------------------------------------------


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and attrs.has(tp)


def _named_sections(tp: Any) -> type | None:
    """The section class of a ``dict[str, Section]`` field (tables by name), else None."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) is dict and len(args) == 2 and args[0] is str and _is_section(args[1]):
        return args[1]
    return None


def sections(root: type | None = None, path: str = "") -> Iterator[Section]:
    """The reference's sections: ``root`` (RunConfig by default) then its nested sections,
    each followed by its own nested ones."""
    if root is None:
        from primerl.config import RunConfig

        root = RunConfig
    hints = typing.get_type_hints(root)
    docs = field_comments(root)
    fields = attrs.fields(root)
    rows = tuple(Row(f.name, type_name(hints[f.name]), default_text(f), docs.get(f.name, ""))
                 for f in fields if not _is_section(hints[f.name]) and not _named_sections(hints[f.name]))
    yield Section(path, root, rows)
    nested = [f for f in fields if _is_section(hints[f.name]) or _named_sections(hints[f.name])]
    if not path:
        rank = {name: i for i, name in enumerate(ORDER)}
        nested.sort(key=lambda f: rank.get(f.name, len(ORDER)))
    for f in nested:
        where = f"{path}.{f.name}" if path else f.name
        named = _named_sections(hints[f.name])
        yield from sections(named, f"{where}.<name>") if named else sections(hints[f.name], where)
        if where in DEFAULT_PLUGIN_KEYS:
            yield default_plugin_section(where)


def default_plugin_section(path: str) -> Section:
    """The keys the default plugin of section ``path`` adds to it (its ``Config``'s own
    fields), found through the registry as ``load_config`` finds them."""
    from primerl.config import PLUGIN_SECTIONS
    from primerl.registry import get_registry
    from primerl.sections import config_class

    key, kind, base = PLUGIN_SECTIONS[path]
    name = attrs.fields_dict(base)[key.partition(".")[2]].default
    cls = config_class(get_registry(), kind, name, base, label=f"{key} = {name!r} (its default)")
    hints, docs, shared = typing.get_type_hints(cls), field_comments(cls), attrs.fields_dict(base)
    rows = tuple(Row(f.name, type_name(hints[f.name]), default_text(f), docs.get(f.name, ""))
                 for f in attrs.fields(cls) if f.name not in shared)
    return Section(path, cls, rows, title=f"`[{path}]` with `{key.partition('.')[2]} = \"{name}\"` (the default)")


def _cell(text: str, prose: bool = False) -> str:
    """Text for a table cell: ``|`` escaped (even in code), and ``*`` in prose (no emphasis)."""
    text = text.replace("|", "\\|")
    return text.replace("*", "\\*") if prose else text


def _docstring(cls: type) -> str:
    """The class's own docstring as Markdown (RST ``code`` -> `code`), or ""."""
    doc = cls.__dict__.get("__doc__")
    if not doc:
        return ""
    paragraphs = [" ".join(p.split()) for p in inspect.cleandoc(doc).split("\n\n")]
    return "\n\n".join(re.sub(r"``(.+?)``", r"`\1`", p) for p in paragraphs if p)


def render() -> str:
    """The whole of ``docs/configuration.md``."""
    parts = [INTRO]
    for section in sections():
        parts.append(f"## {section.heading}\n")
        doc = _docstring(section.cls) if section.path else ""
        if doc:
            parts.append(doc + "\n")
        table = ["| key | type | default | description |", "| --- | --- | --- | --- |"]
        table += [f"| `{r.key}` | `{_cell(r.type)}` | `{_cell(r.default)}` | {_cell(r.description, prose=True)} |"
                  for r in section.rows]
        parts.append("\n".join(table) + "\n")
    return "\n".join(parts)


def main() -> None:
    sys.stdout.write(render())


if __name__ == "__main__":
    main()
