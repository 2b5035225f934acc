"""The swe harness on tasks laid out as real projects are: the checkout is what the tests
import (src/ layouts, packages declared only in pyproject.toml, a fixed copy installed in the
interpreter's environment), results read from pytest's own reports, SWE-bench's row shape,
JSON Lines as written, and the per-task environment made once.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from primerl_swe import repo, sandbox
from primerl_swe.build_tasks import build_layouts, shipped
from primerl_swe.env import Swe, SweConfig
from primerl_swe.records import TaskFileError, load_tasks
from primerl_swe.testenv import TESTBED, make_layered_venv

needs_bwrap = pytest.mark.skipif(sandbox.bwrap_path() is None, reason="bubblewrap is not installed")
GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@example.invalid"}


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    return build_layouts(tmp_path_factory.mktemp("layouts"))


@pytest.fixture(scope="module")
def shadow_python(layouts, tmp_path_factory):
    """An interpreter whose environment (this one's, layered) also holds semverlite 1.1.0, the
    release with every fix, built locally by the task set."""
    venv = tmp_path_factory.mktemp("shadow") / "venv"
    py = make_layered_venv(venv)
    (wheel,) = (layouts.parent / "dists").glob("semverlite-1.1.0-*.whl")
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True,
                   capture_output=True)
    where = subprocess.run([str(py), "-c", "import semverlite, primerl; print(semverlite.__file__)"],
                           capture_output=True, text=True, check=True).stdout.strip()
    assert where.startswith(str(venv)), where  # the installed copy is what a plain import finds
    return py


def _git(args, cwd):
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True,
                          env={**os.environ, **GIT_ENV}).stdout


def _rows(path: Path, prefix: str = "") -> list[dict]:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]
    return [r for r in rows if r["instance_id"].startswith(prefix)]


def _check(tasks: Path, cache: Path, *flags: str, python: str = sys.executable) -> list[dict]:
    r = subprocess.run([python, "-m", "primerl.cli", "env", "check", "swe", "--tasks", str(tasks), "--json",
                        "--env.cache_dir", str(cache), *flags], capture_output=True, text=True, timeout=900)
    assert r.returncode in (0, 1), r.stdout + r.stderr
    return json.loads(r.stdout)


# -- the task file ------------------------------------------------------------------------------


def test_task_files_are_json_lines(layouts):
    """Rows are split on \\n only: a problem statement holding U+2028 (written with
    ensure_ascii=False, as SWE-bench exports) is one row, its text intact."""
    raw = layouts.read_bytes().decode("utf-8")
    assert "\u2028" in raw and len(raw.splitlines()) > raw.count("\n")  # splitlines() would cut the row
    recs = {r.instance_id: r for r in load_tasks(layouts)}
    assert len(recs) == 9
    assert "first\u2028second" in recs["fixtures__strkit-squash-line-separators"].problem_statement
    rec = recs["fixtures__strkit-wrap-strip"]  # SWE-bench's shape: owner/name, JSON-string lists, extra fields
    assert rec.repo_name == "fixtures/strkit" and rec.repo == layouts.parent / "fixtures" / "strkit"
    assert rec.fail_to_pass == ("tests/test_issue_wrap_strip.py::test_wrap_parens_strips[ a, b -(a, b)]",
                                "tests/test_issue_wrap_strip.py::test_wrap_parens_strips[\\t(a, b) -(a, b)]")
    assert rec.extra["version"] == "1.0.0" and "environment_setup_commit" in rec.extra


def test_bad_rows_are_one_line_naming_file_and_line(tmp_path, layouts):
    good = layouts.read_text(encoding="utf-8").split("\n")[0]
    cases = {
        "not JSON": (good + "\n{not json\n", r"t.jsonl:2: not JSON \(Expecting property name"),
        "duplicate": (good + "\n" + good + "\n", r"t.jsonl:2: instance_id 'fixtures__strkit-wrap-strip' is also on line 1"),
        "missing field": ('{"instance_id": "x"}\n', r"t.jsonl:1: missing fields \['repo'"),
        "bad test list": (good.replace('"FAIL_TO_PASS": "[', '"FAIL_TO_PASS": "{[') + "\n", r"FAIL_TO_PASS is a string that is not a JSON list"),
        "test_cmd": (good[:-1] + ', "test_cmd": "make test"}\n', r"test_cmd 'make test' does not run pytest"),
    }
    shutil.copytree(layouts.parent / "fixtures", tmp_path / "fixtures")
    for text, message in cases.values():
        (tmp_path / "t.jsonl").write_text(text, encoding="utf-8")
        with pytest.raises(TaskFileError, match=message):
            load_tasks(tmp_path / "t.jsonl")
    # from the command line: one line naming the problem, exit 2, no traceback
    (tmp_path / "t.jsonl").write_text(cases["duplicate"][0], encoding="utf-8")
    r = subprocess.run([sys.executable, "-m", "primerl.cli", "env", "check", "swe", "--tasks", str(tmp_path / "t.jsonl"),
                        "--json"], capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "400"})
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stdout == "", r.stdout + r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("error:") and "t.jsonl:2: instance_id" in line and "also on line 1" in line


@pytest.mark.slow
def test_owner_name_repos_are_found_under_env_repos(tmp_path, layouts, swe_cache):
    rows = _rows(layouts, "fixtures__strkit")
    (tmp_path / "tasks").mkdir()
    tasks = tmp_path / "tasks" / "t.jsonl"
    tasks.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(TaskFileError, match=r"repo 'fixtures/strkit' is not a folder beside the task file .* "
                                            r"clone it as DIR/fixtures/strkit \(or DIR/fixtures__strkit\) and pass --env.repos DIR"):
        load_tasks(tasks)
    clones = tmp_path / "clones"
    clones.mkdir()
    shutil.copytree(layouts.parent / "fixtures" / "strkit", clones / "fixtures__strkit")
    recs = load_tasks(tasks, repos=clones)
    assert {r.repo for r in recs} == {clones / "fixtures__strkit"} and all(r.repo_problem is None for r in recs)
    # a repo missing under --env.repos is that task's error (the paths tried), not the file's
    other = dict(rows[0], instance_id="elsewhere__x-1", repo="elsewhere/x")
    tasks.write_text("".join(json.dumps(r) + "\n" for r in [rows[0], other]))
    env = Swe(SweConfig(tasks=str(tasks), repos=str(clones), cache_dir=str(swe_cache)))
    if sandbox.bwrap_path() is not None:
        results = {r["instance_id"]: r for r in env.check(oracle=True)}
        assert results[rows[0]["instance_id"]]["reward"] == 1.0, results
        missing = results["elsewhere__x-1"]
        assert missing["reward"] is None and missing["error"] == (
            f"repo 'elsewhere/x' not found (tried {clones}/elsewhere/x, {clones}/elsewhere__x, "
            f"{tmp_path}/tasks/elsewhere/x): clone it as {clones}/elsewhere/x or {clones}/elsewhere__x")


def test_the_shipped_set_is_built_once_on_first_use(tmp_path):
    said = []
    first = shipped("layouts", tmp_path, log=said.append)
    assert len(said) == 1 and "building the shipped task set 'layouts'" in said[0]
    assert shipped("layouts", tmp_path, log=said.append) == first and len(said) == 1
    assert len(load_tasks(first)) == 9


# -- the checkout is what the tests import --------------------------------------------------------


@needs_bwrap
@pytest.mark.slow
def test_layouts_score_one_with_the_fix_and_zero_without(layouts, swe_cache):
    """src/, pyproject-declared and flit/hatchling/setuptools packages: `env check` as users run it."""
    for flags, want in ((["--oracle"], 1.0), ([], 0.0)):
        rows = _check(layouts, swe_cache, *flags)
        assert [r["reward"] for r in rows] == [want] * 9, rows


@needs_bwrap
@pytest.mark.slow
def test_an_installed_copy_with_the_fix_does_not_score_without_the_patch(layouts, shadow_python, tmp_path):
    """semverlite 1.1.0 (every fix in) is installed where primerl runs: without a patch the tasks
    still score 0, with the gold patch 1: the tests import the checkout."""
    tasks = layouts.parent / "semverlite.jsonl"
    tasks.write_text("".join(json.dumps(r) + "\n" for r in _rows(layouts, "fixtures__semverlite")))
    for flags, want in (([], 0.0), (["--oracle"], 1.0)):
        rows = _check(tasks, tmp_path / "cache", *flags, python=str(shadow_python))
        assert [r["reward"] for r in rows] == [want] * 3, rows


def _uninstallable_src_repo(root: Path) -> dict:
    """A src/ layout whose pyproject.toml declares no project (pytest settings only): nothing
    installs the checkout, so its tests find semverlite only where it is installed, if anywhere."""
    from primerl_swe.layouts import SEMVERLITE

    files = {k: v for k, v in SEMVERLITE.files.items() if k != "pyproject.toml"}
    files["pyproject.toml"] = '[tool.pytest.ini_options]\ntestpaths = ["tests"]\n'
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    _git(["init", "--quiet"], root)
    _git(["add", "-A"], root)
    _git(["commit", "--quiet", "-m", "semverlite"], root)
    base = _git(["rev-parse", "HEAD"], root).strip()
    test = root / "tests" / "test_more.py"
    test.write_text("from semverlite import parse\n\n\ndef test_more():\n    assert parse('2.0.0').major == 2\n")
    _git(["add", "-N", "tests/test_more.py"], root)
    test_patch = _git(["diff"], root)
    _git(["rm", "--quiet", "--cached", "tests/test_more.py"], root)
    test.unlink()
    return {"instance_id": "semverlite__uninstalled", "repo": root.name, "base_commit": base, "problem_statement": "x",
            "patch": "", "test_patch": test_patch, "FAIL_TO_PASS": ["tests/test_more.py::test_more"],
            "PASS_TO_PASS": ["tests/test_version.py::test_parse"]}


@needs_bwrap
@pytest.mark.slow
def test_tests_that_cannot_import_the_checkout_are_an_error_not_a_reward(tmp_path, shadow_python):
    row = _uninstallable_src_repo(tmp_path / "semverlite")
    tasks = tmp_path / "t.jsonl"
    tasks.write_text(json.dumps(row) + "\n")
    # nothing named semverlite where primerl runs: the suite cannot be collected, and says why
    (plain,) = _check(tasks, tmp_path / "cache")
    assert plain["reward"] is None and plain["error"].startswith(
        "the tests cannot be collected with test_patch applied: tests/test_more.py: "
        "ModuleNotFoundError: No module named 'semverlite'"), plain
    # a fixed copy installed where primerl runs: the tests would import it; the error names its path
    (shadowed,) = _check(tasks, tmp_path / "cache", python=str(shadow_python))
    site = Path(shadow_python).parent.parent
    assert shadowed["reward"] is None and shadowed["error"].startswith(
        f"the tests import semverlite from {site}/lib/python"), shadowed
    assert "not from the checkout: an installed copy shadows the code under test" in shadowed["error"]


@needs_bwrap
@pytest.mark.slow
def test_deleting_the_package_so_the_installed_copy_is_imported_scores_zero(layouts, shadow_python, tmp_path):
    """The agent removes src/semverlite: the installed fixed copy would pass every test. The
    harness sees the tests import it from outside the checkout: reward 0, not 1, not an error."""
    tasks = layouts.parent / "semverlite.jsonl"
    tasks.write_text("".join(json.dumps(r) + "\n" for r in _rows(layouts, "fixtures__semverlite")))
    code = ("import json, sys; from primerl_swe.env import Swe, SweConfig; "
            "env = Swe(SweConfig(tasks=sys.argv[1], cache_dir=sys.argv[2])); "
            "task = next(t for t in env.tasks('train') if t.id == 'fixtures__semverlite-prerelease'); "
            "state = env.setup(task); out = env.run(state, 'rm -rf src/semverlite && python -c \"import semverlite; "
            "print(semverlite.__file__)\"'); reward = env.reward(task, state); env.cleanup(task, state); "
            "print(json.dumps([out, reward]))")
    r = subprocess.run([str(shadow_python), "-c", code, str(tasks), str(tmp_path / "cache")], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    out, reward = json.loads(r.stdout.splitlines()[-1])
    assert "site-packages/semverlite/__init__.py" in out and reward == 0.0, (out, reward)


# -- pytest's own reports ---------------------------------------------------------------------


@needs_bwrap
@pytest.mark.slow
def test_outcomes_come_from_pytests_reports_for_any_node_id(tmp_path, swe_cache):
    """Node ids with spaces, brackets, unicode; xfail, setup errors, teardown errors, skips."""
    root = tmp_path / "ids"
    (root / "tests").mkdir(parents=True)
    (root / "tests" / "test_ids.py").write_text('''import pytest


@pytest.mark.parametrize("text, expected", [("a, b", "(a, b)"), ("ünï cödé", "x y")])
def test_wrap(text, expected):
    assert text != expected


@pytest.mark.xfail(reason="known")
def test_known_failure():
    assert False


@pytest.fixture
def broken():
    raise RuntimeError("setup broke")


def test_setup_error(broken):
    pass


@pytest.fixture
def bad_teardown():
    yield
    raise RuntimeError("teardown broke")


def test_teardown_error(bad_teardown):
    pass


def test_skipped():
    pytest.skip("not here")


def test_fails():
    assert 1 == 2
''')
    _git(["init", "--quiet"], root)
    _git(["add", "-A"], root)
    _git(["commit", "--quiet", "-m", "ids"], root)
    base = _git(["rev-parse", "HEAD"], root).strip()
    ids = {"tests/test_ids.py::test_wrap[a, b-(a, b)]": "PASSED",
           "tests/test_ids.py::test_wrap[\\xfcn\\xef c\\xf6d\\xe9-x y]": "PASSED",
           "tests/test_ids.py::test_known_failure": "XFAIL", "tests/test_ids.py::test_setup_error": "ERROR",
           "tests/test_ids.py::test_teardown_error": "ERROR", "tests/test_ids.py::test_skipped": "SKIPPED",
           "tests/test_ids.py::test_fails": "FAILED"}
    row = {"instance_id": "ids", "repo": "ids", "base_commit": base, "problem_statement": "", "patch": "",
           "test_patch": "", "FAIL_TO_PASS": list(ids)[:2], "PASS_TO_PASS": []}
    (tmp_path / "t.jsonl").write_text(json.dumps(row) + "\n")
    env = Swe(SweConfig(tasks=str(tmp_path / "t.jsonl"), cache_dir=str(swe_cache)))
    rec = env.records()["ids"]
    work = repo.checkout(rec.repo, base)
    try:
        report, _ = repo.run_tests(work, list(ids), env=env.test_env(rec, work))
    finally:
        repo.remove(work)
    assert report.outcomes == ids
    assert report.passed("tests/test_ids.py::test_known_failure")  # SWE-bench counts XFAIL as passing


# -- the task's environment: made once, cached, recipes ------------------------------------------


@needs_bwrap
@pytest.mark.slow
def test_a_tasks_environment_is_made_once_and_reused(layouts, tmp_path):
    cache = tmp_path / "cache"
    env = Swe(SweConfig(tasks=str(layouts), cache_dir=str(cache)))
    rec = env.records()["fixtures__strkit-wrap-strip"]
    work = repo.checkout(rec.repo, rec.base_commit)
    try:
        made = env.test_env(rec, work)
        assert made.setup_s > 0 and made.installed and made.checkout_at == TESTBED
        # another process (a fresh env object, as in another env worker) finds it in the cache
        again = Swe(SweConfig(tasks=str(layouts), cache_dir=str(cache))).test_env(rec, work)
        assert again.root == made.root and again.setup_s == 0
        out = repo.run("python -c 'import strkit; print(strkit.__file__)'", work, env=again).output
        assert out.strip() == f"{TESTBED}/src/strkit/__init__.py"
    finally:
        repo.remove(work)


@needs_bwrap
@pytest.mark.slow
def test_recipes_run_in_the_sandbox_and_a_failing_one_names_its_command(layouts, tmp_path):
    rows = _rows(layouts, "fixtures__unitconv-c-to-f")
    recipe = dict(rows[0], pre_install=["echo prepared > .prepared"],
                  install="test -f .prepared && python -m pip install -q --no-deps --no-build-isolation --no-index -e .",
                  test_cmd="pytest -x --tb=short")
    failing = dict(rows[0], instance_id="unitconv__failing-recipe", pre_install="exit 7")
    tasks = layouts.parent / "recipes.jsonl"
    tasks.write_text(json.dumps(recipe) + "\n" + json.dumps(failing) + "\n")
    rows = {r["instance_id"]: r for r in _check(tasks, tmp_path / "cache", "--oracle", "--jobs", "1")}
    assert rows["fixtures__unitconv-c-to-f"]["reward"] == 1.0, rows
    assert rows["unitconv__failing-recipe"]["error"].startswith(
        "setting up the task's environment failed: `exit 7` exit code 7"), rows


@needs_bwrap
@pytest.mark.slow
def test_env_prepare_makes_every_environment_ahead_of_the_run(layouts, tmp_path):
    tasks = layouts.parent / "strkit.jsonl"
    tasks.write_text("".join(json.dumps(r) + "\n" for r in _rows(layouts, "fixtures__strkit")))
    cmd = [sys.executable, "-m", "primerl.cli", "env", "prepare", "swe", "--tasks", str(tasks), "--json",
           "--env.cache_dir", str(tmp_path / "cache"), "--offline"]
    first = json.loads(subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True).stdout)
    assert [r["error"] for r in first] == [None] * 3 and all(r["setup_s"] > 0 for r in first), first
    second = json.loads(subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True).stdout)
    assert [r["setup_s"] for r in second] == [0.0] * 3, second


@pytest.mark.slow
def test_the_rlimit_sandbox_makes_the_environment_in_place(layouts, tmp_path):
    """No bubblewrap: each checkout gets its environment beside it, removed with it."""
    tasks = layouts.parent / "one.jsonl"
    tasks.write_text(json.dumps(_rows(layouts, "fixtures__strkit-title")[0]) + "\n")
    env = Swe(SweConfig(tasks=str(tasks), cache_dir=str(tmp_path / "cache"), sandbox="rlimit"))
    (row,) = env.check(oracle=True)
    assert row["reward"] == 1.0, row
    assert not any((tmp_path / "cache").glob("envs/*"))
