"""The ``layouts`` task set: three libraries laid out the ways maintained projects are.

``pyutils`` (:mod:`primerl_swe.taskset`) is a package at the repository's root, which every
harness can import. Real projects mostly are not, and a harness that guesses import paths
scores them wrongly. This set holds one library per layout, each a git repository with a
history (a root commit, then one branch per bug), and rows in SWE-bench's exact shape
(``repo`` as ``owner/name``, the test lists as JSON strings, SWE-bench's extra fields):

* ``fixtures/strkit``: a package under ``src/`` (setuptools), tests that import it as
  installed; parametrized node ids with spaces and brackets, an issue text holding U+2028;
* ``fixtures/unitconv``: a package in ``lib/``, declared only in ``pyproject.toml``
  (hatchling's ``packages``), which no path guess finds;
* ``fixtures/semverlite``: a ``src/`` package built with flit_core whose fixed release is
  also built as a wheel (``dists/semverlite-1.1.0-py3-none-any.whl``): installed into the
  interpreter running primerl, it holds every fix, so a harness that imports it instead of
  the checkout scores 1 with no patch.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class Bug:
    id: str
    file: str
    correct: str
    buggy: str
    issue: str
    test: str  # the regression test file's text (tests/test_issue_<id>.py)
    fail_to_pass: tuple[str, ...] = ()  # node ids, when not one per ``def test_`` (parametrized)


@attrs.frozen
class Library:
    owner: str
    name: str
    version: str  # of the buggy releases; the fixed one is the next minor
    files: dict[str, str]
    existing_tests: tuple[str, ...]  # PASS_TO_PASS: the library's suite, as pytest names its tests
    bugs: tuple[Bug, ...]
    wheel: bool = False  # build the fixed release as a wheel too

    @property
    def repo(self) -> str:
        return f"{self.owner}/{self.name}"


STRKIT = Library(
    owner="fixtures", name="strkit", version="1.0.0",
    files={
        "pyproject.toml": '''[build-system]
requires = ["setuptools>=64"]
build-backend = "setuptools.build_meta"

[project]
name = "strkit"
version = "1.0.0"
description = "String helpers"
requires-python = ">=3.9"

[tool.pytest.ini_options]
testpaths = ["tests"]
''',
        "src/strkit/__init__.py": '"""String helpers."""\n\nfrom strkit.core import squash, title_case, wrap_parens\n\n'
                                  '__all__ = ["squash", "title_case", "wrap_parens"]\n',
        "src/strkit/core.py": '''"""The helpers."""

import re


def wrap_parens(text):
    """``"a, b"`` -> ``"(a, b)"``; surrounding whitespace is dropped and wrapped text is kept."""
    text = text.strip()
    if text.startswith("(") and text.endswith(")"):
        return text
    return f"({text})"


def squash(text):
    """Every run of whitespace (spaces, tabs, newlines, Unicode line separators) becomes one space."""
    return re.sub(r"\\s+", " ", text).strip()


def title_case(text, small=("a", "an", "and", "of", "the")):
    """Capitalised words, small words lower case except the first."""
    words = text.split()
    return " ".join(w.lower() if i and w.lower() in small else w[:1].upper() + w[1:] for i, w in enumerate(words))
''',
        "README.md": "# strkit\n\nString helpers.\n",
        "tests/test_core.py": '''import pytest

from strkit import squash, title_case, wrap_parens


@pytest.mark.parametrize("text, expected", [("a, b", "(a, b)"), ("(a, b)", "(a, b)"), ("x", "(x)")])
def test_wrap_parens(text, expected):
    assert wrap_parens(text) == expected


def test_squash_spaces():
    assert squash("a   b  c") == "a b c"


def test_title_case():
    assert title_case("war and peace") == "War and Peace"
''',
    },
    existing_tests=("tests/test_core.py::test_wrap_parens[a, b-(a, b)]", "tests/test_core.py::test_wrap_parens[(a, b)-(a, b)]",
                    "tests/test_core.py::test_wrap_parens[x-(x)]", "tests/test_core.py::test_squash_spaces",
                    "tests/test_core.py::test_title_case"),
    bugs=(
        Bug("wrap-strip", "src/strkit/core.py", "    text = text.strip()\n", "",
            'wrap_parens(" a, b ") returns "( a, b )": the spaces around the text should go, giving "(a, b)".',
            '''import pytest

from strkit import wrap_parens


@pytest.mark.parametrize("text, expected", [(" a, b ", "(a, b)"), ("\\t(a, b) ", "(a, b)")])
def test_wrap_parens_strips(text, expected):
    assert wrap_parens(text) == expected
''', fail_to_pass=("tests/test_issue_wrap_strip.py::test_wrap_parens_strips[ a, b -(a, b)]",
                   "tests/test_issue_wrap_strip.py::test_wrap_parens_strips[\\t(a, b) -(a, b)]")),
        Bug("squash-line-separators", "src/strkit/core.py", 'return re.sub(r"\\s+", " ", text).strip()',
            'return re.sub(r"[ \\t]+", " ", text).strip()',
            "squash() leaves line breaks alone: squash(\"a\\nb\") is \"a\\nb\", and a text pasted from a PDF, "
            "\"first\u2028second\", keeps its U+2028 line separator. Every run of whitespace should become one space.",
            '''from strkit import squash


def test_squash_newlines_and_line_separators():
    assert squash("a\\nb") == "a b"
    assert squash("first\\u2028second") == "first second"
'''),
        Bug("title-first-small-word", "src/strkit/core.py", "w.lower() if i and w.lower() in small",
            "w.lower() if w.lower() in small",
            'title_case("the art of war") returns "the Art of War"; the first word is always capitalised.',
            '''from strkit import title_case


def test_first_word_is_capitalised():
    assert title_case("the art of war") == "The Art of War"
'''),
    ),
)

UNITCONV = Library(
    owner="fixtures", name="unitconv", version="2.3.0",
    files={
        "pyproject.toml": '''[build-system]
requires = ["hatchling>=1.18"]
build-backend = "hatchling.build"

[project]
name = "unitconv"
version = "2.3.0"
description = "Unit conversions"
requires-python = ">=3.9"

[tool.hatch.build.targets.wheel]
packages = ["lib/unitconv"]
''',
        "lib/unitconv/__init__.py": '"""Unit conversions."""\n\nfrom unitconv.length import convert, parse_length\n'
                                    'from unitconv.temperature import c_to_f, f_to_c\n\n'
                                    '__all__ = ["c_to_f", "convert", "f_to_c", "parse_length"]\n',
        "lib/unitconv/length.py": '''"""Lengths."""

import re

METRES = {"mm": 0.001, "cm": 0.01, "m": 1.0, "km": 1000.0, "in": 0.0254, "ft": 0.3048}


def parse_length(text):
    """``"3.5 km"`` -> ``(3.5, "km")``."""
    m = re.fullmatch(r"\\s*(\\d+(?:\\.\\d+)?)\\s*([a-z]+)\\s*", text)
    if not m:
        raise ValueError(f"not a length: {text!r}")
    return float(m.group(1)), m.group(2)


def convert(value, unit, to):
    """``value`` in ``unit`` expressed in ``to``; ValueError for a unit it does not know."""
    for u in (unit, to):
        if u not in METRES:
            raise ValueError(f"unknown unit {u!r}; known: {', '.join(METRES)}")
    return value * METRES[unit] / METRES[to]
''',
        "lib/unitconv/temperature.py": '''"""Temperatures."""


def c_to_f(c):
    return c * 9 / 5 + 32


def f_to_c(f):
    return (f - 32) * 5 / 9
''',
        "tests/test_length.py": '''from unitconv import convert, parse_length


def test_parse_integer_length():
    assert parse_length("12 cm") == (12.0, "cm")


def test_convert_km_to_m():
    assert convert(2, "km", "m") == 2000
''',
        "tests/test_temperature.py": '''from unitconv import f_to_c


def test_boiling_point():
    assert f_to_c(212) == 100
''',
    },
    existing_tests=("tests/test_length.py::test_parse_integer_length", "tests/test_length.py::test_convert_km_to_m",
                    "tests/test_temperature.py::test_boiling_point"),
    bugs=(
        Bug("c-to-f", "lib/unitconv/temperature.py", "return c * 9 / 5 + 32", "return c * 5 / 9 + 32",
            "c_to_f(100) returns 87.55...; 100 °C is 212 °F.",
            "from unitconv import c_to_f\n\n\ndef test_c_to_f():\n    assert c_to_f(100) == 212\n"
            "    assert c_to_f(-40) == -40\n"),
        Bug("decimal-lengths", "lib/unitconv/length.py", 'r"\\s*(\\d+(?:\\.\\d+)?)\\s*([a-z]+)\\s*"',
            'r"\\s*(\\d+)\\s*([a-z]+)\\s*"',
            'parse_length("3.5 km") raises "not a length"; decimal values should parse.',
            "from unitconv import parse_length\n\n\ndef test_decimal_length():\n"
            '    assert parse_length("3.5 km") == (3.5, "km")\n'),
        Bug("unknown-unit", "lib/unitconv/length.py",
            "    for u in (unit, to):\n        if u not in METRES:\n"
            "            raise ValueError(f\"unknown unit {u!r}; known: {', '.join(METRES)}\")\n", "",
            'convert(1, "m", "yd") raises KeyError: \'yd\'; an unknown unit should be a ValueError naming it.',
            "import pytest\n\nfrom unitconv import convert\n\n\ndef test_unknown_unit_is_value_error():\n"
            '    with pytest.raises(ValueError, match="yd"):\n        convert(1, "m", "yd")\n'),
    ),
)

SEMVERLITE = Library(
    owner="fixtures", name="semverlite", version="1.0.0", wheel=True,
    files={
        "pyproject.toml": '''[build-system]
requires = ["flit_core>=3.4"]
build-backend = "flit_core.buildapi"

[project]
name = "semverlite"
version = "1.0.0"
description = "Semantic version strings"
requires-python = ">=3.9"
''',
        "src/semverlite/__init__.py": '''"""Semantic version strings."""

from semverlite.version import Version, bump, parse

__all__ = ["Version", "bump", "parse"]
''',
        "src/semverlite/version.py": '''"""Versions as (major, minor, patch, prerelease)."""

import re
from typing import NamedTuple

_RX = re.compile(r"(\\d+)\\.(\\d+)\\.(\\d+)(?:-([0-9A-Za-z.]+))?")


class Version(NamedTuple):
    major: int
    minor: int
    patch: int
    pre: str = ""

    def key(self):
        """Sort key: numbers compare as numbers; a prerelease comes before its release."""
        return (self.major, self.minor, self.patch, self.pre == "", self.pre)

    def __str__(self):
        return f"{self.major}.{self.minor}.{self.patch}" + (f"-{self.pre}" if self.pre else "")


def parse(text):
    m = _RX.fullmatch(text.strip())
    if not m:
        raise ValueError(f"not a semantic version: {text!r}")
    return Version(int(m.group(1)), int(m.group(2)), int(m.group(3)), m.group(4) or "")


def bump(version, part):
    """The next version: ``part`` is "major", "minor" or "patch"; lower parts reset to 0."""
    v = parse(version) if isinstance(version, str) else version
    if part == "major":
        return Version(v.major + 1, 0, 0)
    if part == "minor":
        return Version(v.major, v.minor + 1, 0)
    if part == "patch":
        return Version(v.major, v.minor, v.patch + 1)
    raise ValueError(f"part must be major, minor or patch, not {part!r}")
''',
        "tests/test_version.py": '''from semverlite import Version, bump, parse


def test_parse():
    assert parse("1.2.3") == Version(1, 2, 3)


def test_str_round_trip():
    assert str(parse("0.4.10")) == "0.4.10"


def test_bump_major():
    assert bump("1.2.3", "major") == Version(2, 0, 0)
''',
    },
    existing_tests=("tests/test_version.py::test_parse", "tests/test_version.py::test_str_round_trip",
                    "tests/test_version.py::test_bump_major"),
    bugs=(
        Bug("prerelease", "src/semverlite/version.py", 'r"(\\d+)\\.(\\d+)\\.(\\d+)(?:-([0-9A-Za-z.]+))?"',
            'r"(\\d+)\\.(\\d+)\\.(\\d+)(?:-([0-9A-Za-z]+))?"',
            'parse("1.2.3-rc.1") raises "not a semantic version"; "1.2.3-rc1" parses. Prerelease parts are '
            'dot-separated identifiers.',
            "from semverlite import Version, parse\n\n\ndef test_prerelease():\n"
            '    assert parse("1.2.3-rc.1") == Version(1, 2, 3, "rc.1")\n'),
        Bug("numeric-order", "src/semverlite/version.py",
            'return (self.major, self.minor, self.patch, self.pre == "", self.pre)',
            'return str(self)', 'sorted versions put 1.10.0 before 1.9.0; numbers should compare as numbers.',
            "from semverlite import parse\n\n\ndef test_numeric_order():\n"
            '    assert parse("1.10.0").key() > parse("1.9.0").key()\n'
            '    assert parse("1.0.0-rc.1").key() < parse("1.0.0").key()\n'),
        Bug("minor-resets-patch", "src/semverlite/version.py", "return Version(v.major, v.minor + 1, 0)",
            "return Version(v.major, v.minor + 1, v.patch)", 'bump("1.2.3", "minor") gives 1.3.3 instead of 1.3.0.',
            "from semverlite import Version, bump\n\n\ndef test_minor_resets_patch():\n"
            '    assert bump("1.2.3", "minor") == Version(1, 3, 0)\n'),
    ),
)

LIBRARIES = (STRKIT, UNITCONV, SEMVERLITE)
