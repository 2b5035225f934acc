"""``primerl.resume``: what a rerun into a run directory does before any process starts."""

import json
import subprocess
import sys

import pytest
import torch

from primerl.config import ConfigSources, dump_toml, load_config, to_dict
from primerl.errors import PrimerlError
from primerl.resume import MANIFEST, check_checkpoint, config_changes, manifest, may_change, prepare, prepare_run
from primerl.rundir import OPTIMIZER_DIR, STABLE, TRAINER_STATE, RunDir


def cfg_for(out, **overrides):
    base = {"output_dir": str(out), "max_steps": 10, "env.name": "reverse-text", "model.name": "glm5"}
    return load_config(ConfigSources(), explicit={**base, **overrides})


def fake_checkpoint(run: RunDir, n: int) -> None:
    """A small checkpoint with the files a real one has, whole."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    d = run.checkpoint(n)
    d.mkdir(parents=True)
    save_file({"w": torch.ones(4, 4)}, str(d / "model.safetensors"))
    dcp.save({"state": {"exp_avg": torch.zeros(8)}}, checkpoint_id=str(d / OPTIMIZER_DIR), no_dist=True)
    torch.save({"step": n}, d / TRAINER_STATE)
    (d / MANIFEST).write_text(json.dumps(manifest(d)))


def unfinished(tmp_path, done=(2, 4), batches=6):
    """A run directory as a run killed after step ``batches`` leaves it."""
    out = tmp_path / "run"
    run = RunDir(out)
    run.logs.mkdir(parents=True)
    (run.logs / "trainer.log").write_text("step 6\n")
    run.config.write_text(dump_toml(to_dict(cfg_for(out))))
    run.rollouts.mkdir()
    for n in range(1, batches + 1):
        run.batch(n).write_bytes(b"batch")
        run.batch_state(n).write_text("{}")
    (run.rollouts / "step_000007.pt.tmp").write_bytes(b"half")
    for n in range(0, batches + 1):
        run.weights_step(n).mkdir(parents=True)
        (run.weights_step(n) / STABLE).touch()
    run.metrics.write_text("".join(json.dumps({"step": n}) + "\n" for n in range(1, batches + 1)))
    for n in done:
        fake_checkpoint(run, n)
    return run


def test_an_unfinished_run_resumes_from_its_newest_checkpoint_and_sets_the_rest_aside(tmp_path):
    run = unfinished(tmp_path)
    result = prepare_run(cfg_for(run.root))
    assert result.step == 4
    assert result.notes[0] == f"resuming {run.root} from checkpoints/step_000004 (step 4 of 10)"
    previous = result.set_aside
    assert previous.name.startswith("previous-")
    assert run.batch_steps() == [1, 2, 3, 4] and not list(run.rollouts.glob("*.tmp"))
    assert sorted(p.name for p in (previous / "rollouts").iterdir()) == [
        "step_000005.pt", "step_000005.state.json", "step_000006.pt", "step_000006.state.json"]
    assert run.published_steps() == [0, 1, 2, 3, 4]  # 5 and 6 are published again by the trainer
    assert [json.loads(x)["step"] for x in run.metrics.read_text().splitlines()] == [1, 2, 3, 4]
    assert len((previous / "metrics.jsonl").read_text().splitlines()) == 6
    assert (previous / "logs" / "trainer.log").read_text() == "step 6\n" and not list(run.logs.iterdir())
    # prepared again, there is nothing more to set aside
    again = prepare_run(cfg_for(run.root))
    assert again.step == 4 and again.set_aside is None


def test_a_damaged_newest_checkpoint_is_named_and_set_aside(tmp_path):
    run = unfinished(tmp_path)
    opt = run.checkpoint(4) / OPTIMIZER_DIR / ".metadata"
    opt.write_bytes(b"garbage" * 10)
    assert "optimizer/.metadata" in check_checkpoint(run.checkpoint(4))
    result = prepare_run(cfg_for(run.root))
    assert result.step == 2
    assert any(n.startswith("checkpoints/step_000004 is unusable (") for n in result.notes)
    assert (result.set_aside / "checkpoints" / "step_000004").is_dir() and run.checkpoint_steps() == [2]


def test_another_config_is_refused_in_one_line_and_nothing_moves(tmp_path):
    run = unfinished(tmp_path)
    before = sorted(str(p) for p in run.root.rglob("*"))
    with pytest.raises(PrimerlError) as info:
        prepare_run(cfg_for(run.root, **{"trainer.lr": 3e-5, "seed": 7}))
    msg = str(info.value)
    assert "\n" not in msg and "holds an unfinished run (checkpoint at step 4) with another config" in msg
    assert "seed 0 -> 7" in msg and "trainer.lr " in msg and "-> 3e-05" in msg and "--overwrite" in msg
    assert sorted(str(p) for p in run.root.rglob("*")) == before
    # where it runs, how it is served and laid out, and how far it goes may change
    ok = cfg_for(run.root, **{"max_steps": 20, "inference.port": 9001, "trainer.nproc": 2,
                              "trainer.checkpoint_every": 5, "orchestrator.eval_every": 3})
    assert config_changes(run.config, ok) == []
    assert prepare_run(ok).step == 4
    for key in ("inference.vllm_port", "inference.prefill_urls", "launcher.nodes", "trainer.parallel.ep"):
        assert may_change(key), key
    for key in ("trainer.lr", "orchestrator.batch_size", "env.seed", "model.preset", "inference.max_model_len"):
        assert not may_change(key), key


def test_the_backends_config_names_its_own_keys_that_may_change(tmp_path):
    """The embedded engine's queue bound is its section's key, and its Config lists it among
    the keys a continued run may change; its KV cache size changes what it computes."""
    run = unfinished(tmp_path)
    assert config_changes(run.config, cfg_for(run.root, **{"inference.max_queue": 8})) == []
    assert [k for k, _, _ in config_changes(run.config, cfg_for(run.root, **{"inference.kv_slots": 8}))] == [
        "inference.kv_slots"]
    assert not may_change("inference.max_queue")  # a key of no section the core owns


def test_other_kv_store_or_router_options_are_refused_like_any_other_key(tmp_path):
    """They are config keys, in config.toml: a resume whose store or router is set up
    differently is refused, naming the option (no environment variable bypasses the check)."""
    run = unfinished(tmp_path)
    for changed, shown in (({"inference.kv_store": "disk", "inference.kv_store_options": {"block_size": 32}},
                            "inference.kv_store_options.block_size (unset) -> 32"),
                           ({"inference.router": "sticky", "inference.router_options": {"max_sessions": 8}},
                            "inference.router_options.max_sessions (unset) -> 8")):
        with pytest.raises(PrimerlError, match="with another config: ") as info:
            prepare_run(cfg_for(run.root, **changed))
        assert shown in str(info.value)


def test_a_finished_run_is_refused_unless_max_steps_is_raised(tmp_path):
    run = unfinished(tmp_path, done=(2, 4, 6))
    with pytest.raises(PrimerlError, match="already holds this run, finished"):
        prepare_run(cfg_for(run.root, max_steps=6))
    assert prepare_run(cfg_for(run.root, max_steps=8)).step == 6


def test_a_finished_run_with_another_config_is_named_finished(tmp_path):
    """The run in the directory went its whole recorded budget (10 steps): the refusal says
    it is finished and how to go on, not that it is unfinished."""
    run = unfinished(tmp_path, done=(4, 10), batches=10)
    before = sorted(str(p) for p in run.root.rglob("*"))
    with pytest.raises(PrimerlError) as info:
        prepare_run(cfg_for(run.root, **{"env.name": "alphabet-sort", "max_steps": 1}))
    msg = str(info.value)
    assert "\n" not in msg and "holds a finished run (10 steps of 10) with another config: " in msg
    assert 'env.name "reverse-text" -> "alphabet-sort"' in msg
    assert "larger --max-steps" in msg and "--overwrite" in msg and "--output-dir" in msg
    assert sorted(str(p) for p in run.root.rglob("*")) == before


def test_without_a_checkpoint_the_run_starts_over_and_keeps_every_earlier_file(tmp_path):
    run = unfinished(tmp_path, done=())
    dry = prepare_run(cfg_for(run.root), dry_run=True)
    assert dry.set_aside is None and run.metrics.exists()  # a dry run moves nothing
    result = prepare_run(cfg_for(run.root))
    assert result.step is None and "no usable checkpoint: starting over" in result.notes[-1]
    assert sorted(p.name for p in run.root.iterdir()) == [result.set_aside.name]
    for kept in ("config.toml", "metrics.jsonl", "rollouts/step_000006.pt", "weights/step_000006/STABLE",
                 "logs/trainer.log"):
        assert (result.set_aside / kept).exists(), kept
    assert prepare_run(cfg_for(run.root)).set_aside is None  # nothing left to set aside


def test_a_batch_script_prepares_with_the_recorded_config_and_keeps_its_own_log(tmp_path):
    """``python -m primerl.resume OUT --keep logs/slurm-7.out``, as a requeued job runs it:
    config.toml is what is about to run (copied aside, not moved), the job's log stays."""
    run = unfinished(tmp_path, done=())
    (run.logs / "slurm-7.out").write_text("job 7\n")
    r = subprocess.run([sys.executable, "-m", "primerl.resume", str(run.root), "--keep", "logs/slurm-7.out"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "starting over" in r.stdout
    assert run.config.is_file() and (run.logs / "slurm-7.out").is_file()
    (previous,) = run.root.glob("previous-*")
    assert (previous / "config.toml").is_file() and (previous / "logs" / "trainer.log").is_file()
    assert not run.metrics.exists() and not run.rollouts.exists()
    # a finished run: exit 2, one line
    fake_checkpoint(run, 10)
    r = subprocess.run([sys.executable, "-m", "primerl.resume", str(run.root)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "already holds this run, finished" in r.stderr


def test_overwrite_moves_everything_aside(tmp_path):
    run = unfinished(tmp_path)
    result = prepare_run(cfg_for(run.root, **{"trainer.lr": 3e-5}), overwrite=True)
    assert result.step is None and result.notes[0].startswith("--overwrite: starting afresh")
    assert sorted(p.name for p in run.root.iterdir()) == [result.set_aside.name]
    assert (result.set_aside / "checkpoints" / "step_000004" / TRAINER_STATE).is_file()
    assert prepare(run, 10).step is None
