"""The trainer process end to end on the tiny GLM-5 preset, with rollout files written here."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from primerl.algorithms.advantages import GRPO
from primerl.config import ConfigSources, load_config
from primerl.envs.multiturn import prompt_ids
from primerl.rundir import STABLE, TRAINER_STATE, RunDir
from primerl.samples import RolloutBatch, Sample, write_batch
from primerl.sampling import token_logprobs
from primerl.trainer import main as trainer
from primerl.trainer.optim import lr_factor
from primerl.trainer.publish import prune_weights
from primerl.trainer.sft import sft_samples

TRAINER_KEYS = {
    "step", "policy_version", "mismatch_kl", "loss", "masked_fraction", "grad_norm", "lr",
    "time/step", "time/wait", "trainer/tokens_per_s",
}


def _config(out: Path, **overrides):
    base = {
        "output_dir": str(out), "max_steps": 2, "seed": 0,
        "model.name": "glm5", "model.preset": "tiny", "model.seed": 0,
        "env.name": "reverse-text",
        "trainer.seq_len": 128, "trainer.lr": 3e-3, "trainer.router_replay": True,
        "trainer.lr_schedule": "constant", "trainer.warmup_steps": 0, "trainer.checkpoint_every": 0,
        "trainer.loss": "default", "trainer.weight_decay": 0.0,
        "sft.steps": 0,  # pinned: an env's run defaults may ask for a warm-up
        "orchestrator.batch_size": 4, "orchestrator.group_size": 2,
    }
    base.update(overrides)
    return load_config(ConfigSources(), explicit=base)


def _write_rollouts(cfg, steps):
    """Batches like the orchestrator's: chat-template prompts, completions, v0 logprobs and experts."""
    from primerl.registry import get_registry

    _, model, tok = trainer.build_model(cfg)
    env = get_registry().load("env", cfg.env.name)(cfg.env)
    tasks = iter(env.tasks("train"))
    run = RunDir(cfg.output_dir)
    g = torch.Generator().manual_seed(0)
    for n in steps:
        samples = []
        for _group in range(2):
            task = next(tasks)
            prompt = prompt_ids(tok, task.messages(env.system_prompt))
            rewards = []
            for k in range(2):
                text = task.answer if k == 0 else task.answer[::-1]
                completion = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
                tokens = prompt + completion
                temp = 0.8
                with torch.no_grad():
                    o = model(torch.tensor([tokens]), torch.arange(len(tokens))[None], torch.tensor([len(tokens)]))
                lp = token_logprobs(o.logits[0, :-1], torch.tensor(tokens[1:]), temp).tolist()
                lp = [0.0] + lp  # the logprob of token i sits at i
                mask = [0] * len(prompt) + [1] * len(completion)
                samples.append(Sample(
                    tokens=tokens, loss_mask=mask,
                    logprobs=[v if m else 0.0 for v, m in zip(lp, mask, strict=True)],
                    versions=[0 if m else -1 for m in mask],
                    reward=float(torch.rand((), generator=g)), temperature=temp,
                    routed_experts=o.routed_experts[0].to(torch.uint8),  # [len(tokens), L, k]
                    task_id=task.id,
                ))
                rewards.append(samples[-1].reward)
            for s, a in zip(samples[-2:], GRPO()([rewards])[0], strict=True):
                s.advantage = a
        metrics = {"reward/mean": 0.5, "dropped_stale": 0}
        write_batch(run.batch(n), RolloutBatch(step=n, samples=samples, metrics=metrics))


def _weights(out: Path, n: int):
    return load_file(str(RunDir(out).weights_step(n) / "model.safetensors"))


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    cfg = _config(out)
    _write_rollouts(cfg, [1, 2])
    trainer.main(cfg)
    return out


def test_main_end_to_end(full_run):
    out, run = full_run, RunDir(full_run)
    for n in (0, 1, 2):
        assert (run.weights_step(n) / STABLE).is_file()
        assert (run.weights_step(n) / "config.json").is_file()
    assert not list(run.weights.glob(".tmp*"))
    lines = [json.loads(x) for x in run.metrics.read_text().splitlines()]
    assert len(lines) == 2
    for n, rec in enumerate(lines, 1):
        assert set(rec) >= TRAINER_KEYS and rec["reward/mean"] == 0.5 and rec["dropped_stale"] == 0
        assert rec["step"] == rec["policy_version"] == n
        assert rec["grad_norm"] > 0 and rec["time/step"] > 0 and rec["trainer/tokens_per_s"] > 0
    # batch 1 was scored by v0 with the trainer's own function: the ratio is 1
    assert lines[0]["mismatch_kl"] < 1e-6 and lines[0]["masked_fraction"] == 0
    assert lines[1]["mismatch_kl"] > lines[0]["mismatch_kl"]  # batch 2 is one step off-policy
    w0, w1, w2 = (_weights(out, n) for n in (0, 1, 2))
    assert any(not torch.equal(w0[k], w2[k]) for k in w0)
    assert any(not torch.equal(w1[k], w2[k]) for k in w1)
    assert run.latest_checkpoint() == (2, run.checkpoint(2))  # at the end
    assert (run.checkpoint(2) / TRAINER_STATE).is_file()


def test_resume_continues_where_it_stopped(full_run, tmp_path, capsys):
    out = tmp_path / "run"
    run = RunDir(out)
    _write_rollouts(_config(out), [1, 2])
    trainer.main(_config(out, **{"max_steps": 1, "trainer.checkpoint_every": 1}))
    assert (run.checkpoint(1) / TRAINER_STATE).is_file()
    assert len(run.metrics.read_text().splitlines()) == 1
    capsys.readouterr()
    trainer.main(_config(out, **{"max_steps": 2, "trainer.checkpoint_every": 1}))
    log = capsys.readouterr().out
    assert "resumed from" in log and "parallelism single on mesh (dp_replicate=1)" in log
    lines = [json.loads(x) for x in run.metrics.read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2]
    # same result as the uninterrupted run: weights, optimizer state and RNG were restored
    a, b = _weights(full_run, 2), _weights(out, 2)
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=0)


def test_sft_warmup_changes_v0_and_prunes_old_weights(tmp_path):
    out = tmp_path / "run"
    cfg = _config(out, **{"max_steps": 1, "sft.steps": 2, "sft.batch_size": 4,
                          "orchestrator.max_off_policy_steps": 1, "orchestrator.async_level": 1})
    _write_rollouts(cfg, [1])
    _, model, tok = trainer.build_model(cfg)
    trainer.main(cfg)
    v0 = _weights(out, 0)
    init = {k: v for k, v in model.state_dict().items() if k in v0}
    assert any(not torch.equal(v0[k], init[k]) for k in v0)
    # SFT samples: chat-template prompt, then answer + eos under the loss mask
    from primerl.registry import get_registry

    env = get_registry().load("env", "reverse-text")(cfg.env)
    task = next(iter(env.tasks("train")))
    (s,) = sft_samples(env, [task], tok)
    n_ans = len(task.answer) + 1
    assert isinstance(s, Sample) and s.task_id == task.id
    assert s.tokens[-n_ans:] == tok.encode(task.answer, add_special_tokens=False) + [tok.eos_token_id]
    assert s.loss_mask == [0] * (len(s.tokens) - n_ans) + [1] * n_ans
    # pruning keeps the last max_off_policy_steps + 2 versions
    run = RunDir(out)
    for n in range(2, 6):
        run.weights_step(n).mkdir()
    assert prune_weights(run, 5, keep_steps=3) == [0, 1]
    assert sorted(p.name for p in run.weights.iterdir()) == [run.weights_step(n).name for n in range(2, 6)]


def test_bf16_precision_computes_in_bf16_and_keeps_weights_router_and_head_in_float32(tmp_path, capsys):
    """``trainer.precision bfloat16`` on the CPU: the same batch as a float32 trainer, off by
    bf16 rounding only; weights published in float32."""
    stats = {}
    for precision in ("float32", "bfloat16"):
        out = tmp_path / precision
        cfg = _config(out, **{"max_steps": 1, "trainer.precision": precision})
        _write_rollouts(cfg, [1])
        trainer.main(cfg)
        assert f"{precision} compute" in capsys.readouterr().out
        stats[precision] = json.loads(RunDir(out).metrics.read_text().splitlines()[0])
        assert all(t.dtype == torch.float32 for t in _weights(out, 1).values() if t.is_floating_point())
    fp32, bf16 = stats["float32"], stats["bfloat16"]
    # batch 1 was scored in float32 by v0: exact for the float32 trainer, bf16
    # rounding (about 3 significant digits per matmul) for the other
    assert fp32["mismatch_kl"] < 1e-6 and fp32["mismatch_kl"] < bf16["mismatch_kl"] < 1e-3
    assert bf16["routing_agreement"] > 0.9  # the router decides in float32 on bf16-rounded inputs
    assert bf16["grad_norm"] == pytest.approx(fp32["grad_norm"], rel=0.05)


def test_under_autocast_the_router_scores_and_the_logits_stay_float32():
    from primerl.models import ModelConfig
    from primerl.registry import get_registry

    model = get_registry().load("model", "glm5")().build(ModelConfig(name="glm5", preset="tiny", seed=0))
    ids = torch.randint(10, 250, (2, 24), generator=torch.Generator().manual_seed(0))
    args = (ids, torch.arange(24).expand(2, 24), torch.tensor([24, 24]))
    router = model.model.layers[1].mlp.gate
    x = torch.randn(48, model.config.hidden_size)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(*args)
        routing = router(x, torch.ones(48, dtype=torch.bool))
    assert out.logits.dtype == torch.float32 and routing.weights.dtype == torch.float32
    assert torch.equal(routing.ids, router(x, torch.ones(48, dtype=torch.bool)).ids)  # the same choice as float32


def test_lr_schedules():
    f = lr_factor
    assert [f(s, 2, 10, "constant") for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
    assert f(2, 2, 10, "cosine") == pytest.approx(1.0) and f(6, 2, 10, "cosine") == pytest.approx(0.5)
    assert f(6, 2, 10, "linear") == pytest.approx(0.5) and f(10, 2, 10, "linear") == 0.0


# ---- checkpoints: the data position, pruning, damage, a full disk -----------------------


def _position(n: int) -> dict:
    return {"format": "primerl.orchestrator_state", "version": 1, "step": n, "drawn": 2 * n,
            "pending": [[2 * n, "train-x"]], "batch": [2 * n - 2, 2 * n - 1]}


@pytest.fixture(scope="module")
def ckpt_run(tmp_path_factory):
    """Three steps, a checkpoint after each, the newest two kept; the orchestrator's
    position records written beside the batches as the orchestrator writes them."""
    out = tmp_path_factory.mktemp("ckpts")
    cfg = _config(out, **{"max_steps": 3, "trainer.checkpoint_every": 1, "trainer.keep_checkpoints": 2})
    _write_rollouts(cfg, [1, 2, 3])
    run = RunDir(out)
    for n in (1, 2, 3):
        run.batch_state(n).write_text(json.dumps(_position(n)))
    trainer.main(cfg)
    return out


def _copy(src: Path, dst: Path) -> RunDir:
    import shutil

    shutil.copytree(src, dst)
    return RunDir(dst)


def test_checkpoints_carry_the_data_position_and_a_manifest_and_the_newest_are_kept(ckpt_run):
    from primerl.resume import check_checkpoint
    from primerl.rundir import MANIFEST, ORCHESTRATOR_STATE

    run = RunDir(ckpt_run)
    assert run.checkpoint_steps() == [2, 3]  # keep_checkpoints 2: step 1's went once step 3's was complete
    for n in (2, 3):
        ckpt = run.checkpoint(n)
        assert json.loads((ckpt / ORCHESTRATOR_STATE).read_text()) == _position(n)
        files = json.loads((ckpt / MANIFEST).read_text())["files"]
        assert files["model.safetensors"] == (ckpt / "model.safetensors").stat().st_size
        assert {"optimizer/.metadata", TRAINER_STATE} <= set(files)
        assert check_checkpoint(ckpt) is None
        assert torch.load(ckpt / TRAINER_STATE, weights_only=False)["policy_version"] == n


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _garble(path: Path) -> None:
    import os

    path.write_bytes(os.urandom(path.stat().st_size))


@pytest.mark.parametrize(("damage", "target", "problem"), [
    (_truncate, "model.safetensors", "model.safetensors has"),  # the manifest's size
    (_garble, "optimizer/.metadata", "optimizer/.metadata"),
    (lambda p: p.unlink(), "optimizer/__0_0.distcp", "optimizer/__0_0.distcp is missing"),
    (_garble, TRAINER_STATE, TRAINER_STATE),
], ids=["truncated-weights", "garbled-optimizer-metadata", "missing-optimizer-shard", "garbled-trainer-state"])
def test_an_unusable_checkpoint_is_passed_over_for_the_one_before(ckpt_run, tmp_path, damage, target, problem):
    from primerl.resume import MANIFEST, usable_checkpoint

    run = _copy(ckpt_run, tmp_path / "run")
    damage(run.checkpoint(3) / target)
    lines = []
    assert usable_checkpoint(run, log=lines.append) == (2, run.checkpoint(2))
    (line,) = lines
    assert line.startswith("checkpoints/step_000003 is unusable (") and problem in line
    assert line.endswith("falling back to the one before")
    if target == "model.safetensors":  # without a manifest (an older primerl), the header tells
        (run.checkpoint(3) / MANIFEST).unlink()
        assert usable_checkpoint(run) == (2, run.checkpoint(2))


def test_a_checkpoint_that_does_not_load_is_set_aside_and_the_same_command_continues(ckpt_run, tmp_path, capsys):
    """Optimizer shards garbled in place pass the size checks but not torch.load: the trainer
    stops with one line and sets the checkpoint aside; run again, it resumes from the one
    before and trains the step again, its metrics line once."""
    from primerl.errors import PrimerlError
    from primerl.resume import check_checkpoint

    run = _copy(ckpt_run, tmp_path / "run")
    _garble(run.checkpoint(3) / "optimizer" / "__0_0.distcp")
    assert check_checkpoint(run.checkpoint(3)) is None
    cfg = _config(run.root, **{"max_steps": 3, "trainer.checkpoint_every": 1, "trainer.keep_checkpoints": 2})
    with pytest.raises(PrimerlError) as info:
        trainer.main(cfg)
    msg = str(info.value)
    assert msg.startswith("checkpoints/step_000003 does not load (") and "\n" not in msg
    assert "run the same command again to resume from the checkpoint before it" in msg
    (aside,) = run.root.glob("previous-*/checkpoints/step_000003")
    assert str(aside) in msg and run.checkpoint_steps() == [2]
    capsys.readouterr()
    trainer.main(cfg)
    assert "resumed from" in capsys.readouterr().out
    assert [json.loads(x)["step"] for x in run.metrics.read_text().splitlines()] == [1, 2, 3]
    assert run.checkpoint_steps() == [2, 3] and check_checkpoint(run.checkpoint(3)) is None


def _small_tmpfs(path: Path, size: str) -> bool:
    """Mount a tmpfs of ``size`` on ``path`` (root only); False when this machine cannot."""
    import os
    import subprocess

    if os.geteuid() != 0:
        return False
    path.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def test_a_full_disk_while_checkpointing_is_one_line_and_the_last_checkpoint_stays_usable(tmp_path):
    """A checkpoint is about 13 MB; on a 20 MB tmpfs the first fits and the second does
    not. As root a real tmpfs fills up (ENOSPC); elsewhere checkpoints/ is made read-only,
    which fails the first checkpoint the same way (EACCES)."""
    import os
    import subprocess

    from primerl.errors import PrimerlError
    from primerl.resume import check_checkpoint

    out = tmp_path / "run"
    run = RunDir(out)
    cfg = _config(out, **{"max_steps": 2, "trainer.checkpoint_every": 1})
    _write_rollouts(cfg, [1, 2])
    mounted = _small_tmpfs(run.checkpoints, "20m")
    if not mounted:
        if os.geteuid() == 0:
            pytest.skip("cannot mount a tmpfs here (no CAP_SYS_ADMIN)")
        run.checkpoints.mkdir(parents=True)
        run.checkpoints.chmod(0o555)
    try:
        with pytest.raises(PrimerlError) as info:
            trainer.main(cfg)
        msg = str(info.value)
        assert "\n" not in msg
        if mounted:
            assert msg.startswith("could not write checkpoints/step_000002: ") and "No space left on device" in msg
            assert "the last complete checkpoint, checkpoints/step_000001, is intact" in msg
            assert run.checkpoint_steps() == [1] and check_checkpoint(run.checkpoint(1)) is None
            assert not list(run.checkpoints.glob(".tmp*"))  # the half-written one is gone
            # room again: the same command resumes from it and finishes
            subprocess.run(["mount", "-o", "remount,size=64m", str(run.checkpoints)], check=True)
            trainer.main(cfg)
            assert run.checkpoint_steps() == [1, 2]
            assert [json.loads(x)["step"] for x in run.metrics.read_text().splitlines()] == [1, 2]
        else:
            assert msg.startswith("could not write checkpoints/step_000001: Permission denied")
            assert "there is no earlier checkpoint" in msg
    finally:
        if mounted:
            subprocess.run(["umount", str(run.checkpoints)], check=False)
        elif run.checkpoints.exists():
            run.checkpoints.chmod(0o755)
