"""Every config in examples/ resolves (`primerl run @ FILE --dry-run`): each built-in env's
laptop run, and each model family's cluster layout, which `primerl plan` says fits."""

import json
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from primerl.config import dump_toml, read_toml
from primerl.inference import InferenceConfig

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
LAPTOP = sorted(EXAMPLES.glob("*.toml"))
CLUSTER = sorted(EXAMPLES.glob("cluster/*.toml"))


def primerl(*args):
    return subprocess.run([sys.executable, "-m", "primerl.cli", *args], capture_output=True, text=True, timeout=120)


def test_every_built_in_env_and_model_family_has_an_example():
    from primerl.registry import get_registry

    envs = {c.name for c in get_registry().of_kind("env")}
    text = "\n".join(p.read_text() for p in LAPTOP)
    assert all(f'name = "{e}"' in text for e in envs), envs
    models = {c.name for c in get_registry().of_kind("model")} - {"hf", "glm5"}  # glm5: examples/glm5-swe
    assert {p.stem for p in CLUSTER} == models
    for p in [*LAPTOP, *CLUSTER]:
        assert p.read_text().startswith("# "), f"{p.name}: its first line says what it is for"


@pytest.mark.parametrize("path", LAPTOP, ids=lambda p: p.name)
def test_a_laptop_example_resolves(path, tmp_path):
    r = primerl("run", "@", str(path), "--dry-run", "--output-dir", str(tmp_path / "run"))
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("path", CLUSTER, ids=lambda p: p.name)
def test_a_cluster_example_resolves_to_a_layout_that_fits(path, tmp_path):
    """Resolved with the embedded backend's keys and the filesystem channel (vLLM and CUDA
    are not here); everything the launcher and the trainer's layout read is the example's."""
    example = read_toml(path)
    shared = attrs.fields_dict(InferenceConfig)
    example["inference"] = {k: v for k, v in example["inference"].items() if k in shared} | {"backend": "embedded"}
    example["trainer"]["weight_channel"] = "filesystem"
    cfg = tmp_path / path.name
    cfg.write_text(dump_toml(example))
    r = primerl("run", "@", str(cfg), "--dry-run", "--output-dir", str(tmp_path / "run"))
    assert r.returncode == 0, r.stdout + r.stderr
    launcher, par = example["launcher"], example["trainer"]["parallel"]
    plan = primerl("plan", "--model", example["model"]["name"], "--preset", "full",
                   "--nodes", str(launcher["trainer_nodes"]), "--gpus-per-node", str(launcher["gpus_per_node"]),
                   "--seq-len", str(example["trainer"]["seq_len"]), "--dp-replicate", str(par["dp_replicate"]),
                   "--dp-shard", str(par["dp_shard"]), "--cp", str(par["cp"]), "--ep", str(par["ep"]), "--json")
    assert plan.returncode == 0, plan.stderr
    assert json.loads(plan.stdout)["fits"], plan.stdout
