"""The swe harness on projects whose build writes into the source tree: hatch-vcs's
``version-file`` and a custom hatch build hook (a ``src/`` layout), setuptools-scm's
``version_file`` and a setuptools ``build_py`` that writes a module (a flat layout), and a
``pre_install`` that edits a tracked file. The real build backends run (from primerl's
environment, as the swe plugin depends on them); every episode's checkout holds what the
task's one install wrote, and a generated file the install does not write is named.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from primerl_swe import generated, repo, sandbox
from primerl_swe.env import Swe, SweConfig

needs_bwrap = pytest.mark.skipif(sandbox.bwrap_path() is None, reason="bubblewrap is not installed")
GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@example.invalid"}

# hatchling + hatch-vcs, src/ layout: the vcs hook writes _version.py, a custom hook _build_info.py
TALLYHO = {
    "pyproject.toml": """\
[build-system]
requires = ["hatchling", "hatch-vcs"]
build-backend = "hatchling.build"

[project]
name = "tallyho"
dynamic = ["version"]

[tool.hatch.version]
source = "vcs"

[tool.hatch.build.hooks.vcs]
version-file = "src/tallyho/_version.py"

[tool.hatch.build.hooks.custom]

[tool.hatch.build.targets.wheel]
packages = ["src/tallyho"]
""",
    ".gitignore": "src/tallyho/_version.py\nsrc/tallyho/_build_info.py\n__pycache__/\n",
    "hatch_build.py": """\
from pathlib import Path

from hatchling.builders.hooks.plugin.interface import BuildHookInterface


class BuildInfo(BuildHookInterface):
    def initialize(self, version, build_data):
        Path(self.root, "src", "tallyho", "_build_info.py").write_text(f"TARGET = {self.target_name!r}\\n")
""",
    "src/tallyho/__init__.py": "from ._build_info import TARGET\nfrom ._version import __version__\n"
                               "from .core import tally\n",
    "src/tallyho/core.py": """\
def tally(items):
    \"\"\"(item, count) pairs, the most common first (ties in first-seen order).\"\"\"
    counts = {}
    for item in items:
        counts[item] = counts.get(item, 0) + 1
    return sorted(counts.items(), key=lambda kv: kv[1])
""",
    "tests/test_tally.py": """\
import tallyho


def test_counts():
    assert dict(tallyho.tally("abca")) == {"a": 2, "b": 1, "c": 1}


def test_version_and_build_info():
    assert tallyho.__version__ == "1.0.0" and tallyho.TARGET == "wheel"
""",
}
TALLYHO_FIX = {"src/tallyho/core.py": TALLYHO["src/tallyho/core.py"].replace("kv[1])", "-kv[1])")}
TALLYHO_TEST = {"tests/test_tally.py": TALLYHO["tests/test_tally.py"] + """

def test_most_common_first():
    assert tallyho.tally("abcbb") == [("b", 3), ("a", 1), ("c", 1)]
"""}

# setuptools + setuptools-scm, flat layout: version_file, and build_py writes _tables.py
UNITSUM = {
    "pyproject.toml": """\
[build-system]
requires = ["setuptools>=64", "setuptools-scm>=8"]
build-backend = "setuptools.build_meta"

[project]
name = "unitsum"
dynamic = ["version"]

[tool.setuptools]
packages = ["unitsum"]

[tool.setuptools_scm]
version_file = "unitsum/_version.py"
""",
    "setup.py": """\
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildTables(build_py):
    def run(self):
        Path("unitsum", "_tables.py").write_text('FACTORS = {"m": 1.0, "cm": 0.01, "km": 1000.0}\\n')
        super().run()


setup(cmdclass={"build_py": BuildTables})
""",
    ".gitignore": "unitsum/_version.py\nunitsum/_tables.py\n__pycache__/\n",
    "unitsum/__init__.py": "from ._version import __version__\nfrom ._tables import FACTORS\n"
                           "from .config import STRICT\nfrom .core import total\n",
    "unitsum/config.py": "STRICT = True\n",
    "unitsum/core.py": """\
from ._tables import FACTORS


def total(quantities, unit="m"):
    \"\"\"The sum of (value, unit) pairs, in ``unit``.\"\"\"
    return sum(v * FACTORS[u] for v, u in quantities) * FACTORS[unit]
""",
    "tests/test_total.py": """\
import unitsum


def test_total_in_metres():
    assert unitsum.total([(1, "km"), (50, "cm")]) == 1000.5


def test_version_and_tables():
    assert unitsum.__version__.startswith("2.1.") and unitsum.FACTORS["cm"] == 0.01


def test_lenient_as_the_recipe_configures():
    assert unitsum.STRICT is False
""",
}
UNITSUM_FIX = {"unitsum/core.py": UNITSUM["unitsum/core.py"].replace("* FACTORS[unit]", "/ FACTORS[unit]")}
UNITSUM_TEST = {"tests/test_total.py": UNITSUM["tests/test_total.py"] + """

def test_total_in_kilometres():
    assert unitsum.total([(1, "km"), (500, "m")], "km") == 1.5
"""}
LENIENT = "sed -i 's/STRICT = True/STRICT = False/' unitsum/config.py"


def _git(args, cwd):
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True,
                          env={**os.environ, **GIT_ENV}).stdout


def _write(root: Path, files: dict[str, str]) -> None:
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)


def _diff(root: Path, files: dict[str, str]) -> str:
    _write(root, files)
    patch = _git(["diff"], root)
    _git(["checkout", "--", *files], root)
    return patch


def _project(root: Path, files, tag, fix, test, instance_id, f2p, p2p, **recipe) -> dict:
    """A repository of ``files`` tagged ``tag``, and its task row (gold ``fix``, ``test`` added)."""
    root.mkdir(parents=True)
    _write(root, files)
    _git(["init", "--quiet"], root)
    _git(["add", "-A"], root)
    _git(["commit", "--quiet", "-m", "base"], root)
    _git(["tag", tag], root)
    return {"instance_id": instance_id, "repo": root.name, "base_commit": _git(["rev-parse", "HEAD"], root).strip(),
            "problem_statement": "The result is wrong.", "patch": _diff(root, fix), "test_patch": _diff(root, test),
            "FAIL_TO_PASS": f2p, "PASS_TO_PASS": p2p, **recipe}


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("generated")
    rows = [_project(root / "tallyho", TALLYHO, "v1.0.0", TALLYHO_FIX, TALLYHO_TEST, "tallyho-order",
                     ["tests/test_tally.py::test_most_common_first"],
                     ["tests/test_tally.py::test_counts", "tests/test_tally.py::test_version_and_build_info"]),
            _project(root / "unitsum", UNITSUM, "2.1.0", UNITSUM_FIX, UNITSUM_TEST, "unitsum-convert",
                     ["tests/test_total.py::test_total_in_kilometres"],
                     ["tests/test_total.py::test_total_in_metres", "tests/test_total.py::test_version_and_tables",
                      "tests/test_total.py::test_lenient_as_the_recipe_configures"], pre_install=[LENIENT])]
    path = root / "tasks.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _check(tasks: Path, cache: Path, *flags: str) -> dict[str, dict]:
    r = subprocess.run([sys.executable, "-m", "primerl.cli", "env", "check", "swe", "--tasks", str(tasks), "--json",
                        "--env.cache_dir", str(cache), "--jobs", "1", *flags], capture_output=True, text=True,
                       timeout=900)
    assert r.returncode in (0, 1), r.stdout + r.stderr
    return {row["instance_id"]: row for row in json.loads(r.stdout)}


@needs_bwrap
@pytest.mark.slow
def test_projects_whose_build_writes_into_the_tree_score_one_with_the_fix_and_zero_without(tasks, swe_cache):
    oracle = _check(tasks, swe_cache, "--oracle")
    assert {k: (r["reward"], r["error"]) for k, r in oracle.items()} == {
        "tallyho-order": (1.0, None), "unitsum-convert": (1.0, None)}, oracle
    plain = _check(tasks, swe_cache)
    assert {k: (r["reward"], r["error"]) for k, r in plain.items()} == {
        "tallyho-order": (0.0, None), "unitsum-convert": (0.0, None)}, plain


@needs_bwrap
@pytest.mark.slow
def test_what_the_install_wrote_is_in_every_episodes_checkout_without_a_rebuild(tasks, tmp_path):
    cache = tmp_path / "cache"
    env = Swe(SweConfig(tasks=str(tasks), cache_dir=str(cache)))
    recs = env.records()
    want = {"tallyho-order": {"src/tallyho/_version.py", "src/tallyho/_build_info.py"},
            "unitsum-convert": {"unitsum/_version.py", "unitsum/_tables.py", "unitsum/config.py"}}
    for iid, files in want.items():
        work = env._checkout(recs[iid])
        try:
            made = env.test_env(recs[iid], work)
            assert made.setup_s > 0 and files <= set(made.written.files), made.written
            assert not [f for f in made.written.files if "__pycache__" in f or f.endswith(".pyc")], made.written
            assert all((work / f).is_file() for f in files)
        finally:
            repo.remove(work)
    # a second process: the environment comes from the cache, its files are laid in, nothing is built
    again = Swe(SweConfig(tasks=str(tasks), cache_dir=str(cache)))
    task = next(t for t in again.tasks("train") if t.id == "unitsum-convert")
    first = again.setup(task)
    try:
        work = Path(first["workdir"])
        assert again._envs["unitsum-convert"].setup_s == 0
        assert (work / "unitsum/config.py").read_text() == "STRICT = False\n"  # pre_install's edit
        assert "FACTORS" in (work / "unitsum/_tables.py").read_text()
        out = again.run(first, "python -c 'import unitsum; print(unitsum.__version__, unitsum.__file__)'")
        assert " /tmp/testbed/unitsum/__init__.py" in out and "\n2.1." in out, out
        again.write_file(first, "unitsum/_version.py", "__version__ = 'broken by the agent'\n")
    finally:
        again.cleanup(task, first)
    second = again.setup(task)  # the agent's edit of a generated file stays in its own episode
    try:
        assert "version = '2.1." in (Path(second["workdir"]) / "unitsum/_version.py").read_text()
    finally:
        again.cleanup(task, second)


@needs_bwrap
@pytest.mark.slow
def test_a_generated_file_the_install_does_not_write_is_named(tasks, tmp_path):
    rows = [json.loads(line) for line in tasks.read_text().splitlines()]
    row = dict(next(r for r in rows if r["instance_id"] == "unitsum-convert"), instance_id="unitsum-noinstall",
               install="true", pre_install=[])
    path = tasks.parent / "noinstall.jsonl"
    path.write_text(json.dumps(row) + "\n")
    (checked,) = _check(path, tmp_path / "cache", "--oracle").values()
    assert checked["reward"] is None and checked["error"] == (
        "the tests cannot be collected with the gold patch and test_patch applied: tests/test_total.py: "
        "ModuleNotFoundError: No module named 'unitsum._version'; unitsum/_version.py is a file the build writes "
        "(pyproject.toml [tool.setuptools_scm] version_file) and the task's install (`true`) did not write it: "
        "give the task an `install` or `pre_install` recipe that does (the default editable install runs the "
        "project's build hooks in place)"), checked


def test_the_explanation_names_ignored_and_compiled_modules(tmp_path):
    root = tmp_path / "proj"
    _write(root, {".gitignore": "pkg/_gen.py\n", "pkg/__init__.py": "", "pkg/_speedups.pyx": "", "pkg/core.py": ""})
    _git(["init", "--quiet"], root)
    gdir = root / ".git"
    none = generated.Written()
    said = generated.explain("ModuleNotFoundError: No module named 'pkg._gen'", root, gdir, none, "make")
    assert said.startswith("; pkg/_gen.py is a file the build writes (git ignores it) and the task's install "
                           "(`make`) did not write it"), said
    said = generated.explain("ModuleNotFoundError: No module named 'pkg._speedups'", root, gdir, none, "make")
    assert said.startswith("; pkg/_speedups is a file the build writes (compiled from pkg/_speedups.pyx)"), said
    # a module that is simply missing (not generated) and one that is there: nothing to add
    assert generated.explain("ModuleNotFoundError: No module named 'pkg.other'", root, gdir, none, "make") == ""
    assert generated.explain("ModuleNotFoundError: No module named 'pkg.core'", root, gdir, none, "make") == ""
    declared = generated.Written(missing=("pkg/_v.py (setup.py write_to)",))
    said = generated.explain("ImportError: cannot import name 'x'", root, gdir, declared, "make")
    assert said.startswith("; the build declares pkg/_v.py (setup.py write_to), which the task's install (`make`) "
                           "did not write"), said
