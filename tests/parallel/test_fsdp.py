"""The ``fsdp`` strategy on real gloo ranks: the same step as one process, checkpoints
that resume on another number of ranks, the layout rules, and a whole run under torchrun."""

import json
import subprocess
import sys

import pytest
import torch
from primerl_fsdp.parity import max_rel_err, step_on_layout
from primerl_fsdp.ranks import run_on_ranks

from primerl.config import ConfigSources, load_config
from primerl.errors import ConfigError
from primerl.parallel import ParallelConfig

pytestmark = pytest.mark.slow  # every test starts torch.distributed ranks


@pytest.fixture(scope="module")
def one_process():
    return run_on_ranks(1, step_on_layout, "qwen3-moe", {}, True)[0]


@pytest.mark.parametrize("parallel", [{"dp_shard": 2}, {"dp_shard": 2, "ep": 2}, {"dp_shard": 2, "cp": 2, "ep": 2}],
                         ids=["fsdp", "fsdp+ep", "fsdp+ep+cp"])
def test_ranks_compute_the_step_of_one_process(one_process, parallel):
    ranks = run_on_ranks(ParallelConfig(**parallel).world_size(), step_on_layout, "qwen3-moe", parallel, True)
    assert max_rel_err(one_process, ranks[0]) < 1e-4
    assert all(r["loss"] == ranks[0]["loss"] and r["grad_norm"] == ranks[0]["grad_norm"] for r in ranks)
    assert ranks[0]["grad_norm"] == pytest.approx(one_process["grad_norm"], rel=1e-4)


def checkpoint_then_resume(model_name: str, parallel: dict, directory: str, save: bool) -> dict:
    """Train one step on this layout and checkpoint it (save), or resume that checkpoint
    on this layout and return the restored optimizer state in full (load)."""
    from pathlib import Path

    import attrs
    from primerl_fsdp.parity import full_gradients, samples

    from primerl.config import RunConfig
    from primerl.models import ModelConfig
    from primerl.parallel import device_mesh, world_size
    from primerl.registry import get_registry
    from primerl.rundir import RunDir
    from primerl.trainer.main import load_parallelism
    from primerl.trainer.optim import make_optimizer, make_scheduler
    from primerl.trainer.publish import load_resume_state, load_resume_weights, save_checkpoint

    cfg = RunConfig()
    cfg.trainer = attrs.evolve(cfg.trainer, seq_len=96, nproc=world_size(), parallel=ParallelConfig(**parallel))
    adapter = get_registry().load("model", model_name)()
    model = adapter.build(ModelConfig(name=model_name, preset="tiny", dtype="float32", seed=5)).train()
    run = RunDir(Path(directory))
    if not save:
        load_resume_weights(run.checkpoint(1), model, adapter=adapter)
    strategy = load_parallelism(cfg.trainer.resolved_parallelism())
    with device_mesh(strategy.mesh_shape(world_size(), cfg.trainer.parallel.resolved(world_size()))) as mesh:
        model, optimizer, _ = strategy.parallelize(model, mesh, lambda m: make_optimizer(m, 1e-2, 0.0))
        scheduler = make_scheduler(optimizer, cfg)
        if save:
            from primerl.algorithms import build_loss
            from primerl.trainer.packing import pack
            from primerl.trainer.step import rl_step

            rl_step(model, optimizer, pack(samples(model.config.vocab_size), 96), build_loss("default"), cfg, strategy)
            scheduler.step()
            save_checkpoint(run, 1, model, optimizer, scheduler, adapter=adapter, tokenizer=None,
                            parallelism=strategy)
        else:
            assert load_resume_state(run.checkpoint(1), model, optimizer, scheduler, parallelism=strategy) == 1
        # the optimizer's first moments, in full, as gradients are gathered
        for p in model.parameters():
            p.grad = optimizer.state[p]["exp_avg"].clone() if p in optimizer.state else None
        moments = full_gradients(model, strategy)
        weights = {}
        for _unit, part in strategy.full_weights(model):
            weights.update({k: v.clone() for k, v in part.items()})
    return {"moments": moments, "weights": weights}


@pytest.mark.parametrize("saved_on, resumed_on", [({"dp_shard": 2, "ep": 2}, {}), ({}, {"dp_shard": 2})],
                         ids=["2-ranks-ep-to-1", "1-to-2-ranks"])
def test_a_checkpoint_resumes_on_another_number_of_ranks(tmp_path, saved_on, resumed_on):
    saved = run_on_ranks(2 if saved_on else 1, checkpoint_then_resume, "qwen3-moe", saved_on, str(tmp_path), True)[0]
    resumed = run_on_ranks(2 if resumed_on else 1, checkpoint_then_resume, "qwen3-moe", resumed_on, str(tmp_path),
                           False)[0]
    assert saved["weights"].keys() == resumed["weights"].keys()
    assert all(torch.equal(saved["weights"][k], resumed["weights"][k]) for k in saved["weights"])
    assert any(bool(m.abs().sum()) for m in saved["moments"].values())
    for name, m in saved["moments"].items():
        assert torch.equal(m, resumed["moments"][name]), name


def test_cpu_offload_on_a_cpu_trainer_is_refused_with_the_reason():
    with pytest.raises(RuntimeError, match="cpu_offload keeps parameters.*leave cpu_offload off"):
        run_on_ranks(2, step_on_layout, "qwen3-moe", {"dp_shard": 2, "cpu_offload": True})


def test_layouts_that_do_not_fit_are_refused_naming_the_keys():
    assert ParallelConfig(ep=2).resolved(4).dp_shard == 4
    with pytest.raises(ConfigError, match=r"must equal the trainer's ranks, nodes x trainer.nproc = 2"):
        ParallelConfig(dp_shard=4).resolved(2)
    with pytest.raises(ConfigError, match=r"ep \(3\) must divide dp_shard x cp"):
        ParallelConfig(ep=3).resolved(2)
    with pytest.raises(ConfigError, match="trainer.parallel.ep"):
        load_config(ConfigSources(overrides=[("trainer.nproc", "2"), ("trainer.parallel.ep", "4")]))
    cfg = load_config(ConfigSources(overrides=[("trainer.nproc", "2")]))
    assert cfg.trainer.resolved_parallelism() == "fsdp"
    assert load_config(ConfigSources()).trainer.resolved_parallelism() == "single"


@pytest.mark.slow
def test_a_run_trains_with_two_trainer_ranks_and_expert_parallel(tmp_path):
    out = tmp_path / "run"
    small = ["--sft.steps", "0", "--orchestrator.batch_size", "8", "--orchestrator.group_size", "4",
             "--orchestrator.max_tokens", "8", "--trainer.seq_len", "256"]
    r = subprocess.run([sys.executable, "-m", "primerl.cli", "run", "--model", "kimi", "--env", "reverse-text",
                        "--max-steps", "2", "--output-dir", str(out), *small, "--trainer.nproc", "2",
                        "--trainer.parallel.ep", "2", "--trainer.router_replay"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    log = (out / "logs" / "trainer.log").read_text()
    assert "parallelism fsdp on mesh (dp_replicate=1, dp_shard=2, cp=1)" in log and "over ep" in log
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]  # rank 0 alone writes
    # on-policy, replayed: the trainer's own choice may differ only at near-ties (~1e-7 apart)
    assert rows[0]["routing_agreement"] >= 0.99 and rows[0]["mismatch_kl"] < 1e-6
    assert (out / "checkpoints" / "step_000002" / "optimizer" / ".metadata").exists()
    assert (out / "weights" / "step_000002" / "STABLE").exists()
