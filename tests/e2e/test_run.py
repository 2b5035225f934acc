"""`primerl run` end to end, as a user runs it: real processes, a real run directory."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SMALL = ["--sft.steps", "0", "--orchestrator.batch_size", "8", "--orchestrator.group_size", "4",
         "--orchestrator.max_tokens", "8", "--trainer.seq_len", "256"]


def descendants(pid: int) -> set[int]:
    """All processes below pid (read from /proc, no psutil needed)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in found:
                found.add(c)
                todo.append(c)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except OSError:
        return False


def test_third_party_env_trains_three_steps(venv, tmp_path):
    out = tmp_path / "run"
    r = subprocess.run([str(venv), "-m", "primerl.cli", "run", "--model", "glm5", "--env", "echo-digits",
                        "--max-steps", "3", "--output-dir", str(out), *SMALL],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    for key in ("step", "reward/mean", "policy_version", "off_policy/max", "dropped_stale", "mismatch_kl",
                "time/step", "throughput/sampled_tokens_per_s", "batch/sampled_tokens"):
        assert key in rows[-1], key
    for prev, row in zip(rows, rows[1:]):  # never more than the batch's tokens over the wall time between step ends
        wall = row["time/end"] - prev["time/end"]
        assert 0 < row["throughput/sampled_tokens_per_s"] <= row["batch/sampled_tokens"] / wall * 1.01 + 1e-6, (prev, row)
    assert (out / "reward.png").stat().st_size > 0
    assert (out / "weights" / "step_000003" / "STABLE").exists()
    assert "reward curve" in r.stdout
    # a random-weight preset with no warm-up: the run says how to give RL something to improve
    assert "starts from random weights (preset 'tiny') and sft.steps is 0" in " ".join(r.stdout.split())
    # the same command again says the run is finished, where its results are and how to train
    # again, exits 0, and clobbers nothing
    again = subprocess.run([str(venv), "-m", "primerl.cli", "run", "--model", "glm5", "--env", "echo-digits",
                            "--max-steps", "3", "--output-dir", str(out), *SMALL],
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"{out} already holds this run, finished (3 steps of 3)" in again.stdout
    assert "reward curve" in again.stdout and "--max-steps N" in again.stdout and "--overwrite" in again.stdout
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3


ALLOWED_ENV = {"PRIMERL_API_KEY", "PRIMERL_PLUGINS", "PRIMERL_DISABLE_PLUGINS", "PRIMERL_THREADS"}


def primerl_environ(pid: int) -> set[str]:
    """The PRIMERL_* variables in a running process's environment."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:  # gone meanwhile
        return set()
    return {kv.split(b"=", 1)[0].decode() for kv in raw.split(b"\0") if kv.startswith(b"PRIMERL_")}


def test_ctrl_c_stops_every_child_and_no_child_got_settings_from_the_environment(tmp_path):
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRIMERL_")} | {"PRIMERL_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "primerl.cli", "run", "--model", "glm5", "--env", "reverse-text",
                             "--max-steps", "1000", "--output-dir", str(out), *SMALL, "--inference.replicas", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.time() + 300
    kids: set[int] = set()
    while time.time() < deadline:  # wait until training is under way: all three children live
        kids |= descendants(proc.pid)
        if (out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().strip():
            break
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.5)
    kids |= descendants(proc.pid)
    assert len(kids) >= 4
    # every process of the run (servers, orchestrator, trainer, env workers) has only the allowed
    # PRIMERL_* variables: what the launcher discovered went into the run-time record
    assert set().union(*(primerl_environ(k) for k in kids)) <= ALLOWED_ENV
    assert len(json.loads((out / "runtime.json").read_text())["inference_urls"]) == 2
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert "stopping inference, orchestrator and trainer" in err
    time.sleep(0.5)
    assert [k for k in kids if alive(k)] == []


def test_a_crashing_child_stops_the_run_with_a_clear_message(tmp_path):
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "primerl.cli", "run", "--model", "glm5", "--env", "reverse-text",
                        "--max-steps", "2", "--output-dir", str(out), *SMALL,
                        "--trainer.seq_len", "16"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1
    assert "the trainer process exited with code" in r.stderr and "stopped the others" in r.stderr
    assert "seq_len" in r.stderr  # the log tail says what went wrong
    assert "Traceback" not in r.stderr.split("Full log")[0].splitlines()[0]


def test_shm_weight_channel_runs_and_cleans_up(tmp_path):
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "primerl.cli", "run", "--model", "glm5", "--env", "reverse-text",
                        "--max-steps", "2", "--output-dir", str(out), *SMALL, "--trainer.weight_channel", "shm"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (out / "weights" / "step_000002" / "shm.safetensors").is_symlink()
    log = (out / "logs" / "orchestrator.log").read_text()
    assert "inference now serves policy v" in log
    from primerl.rundir import RunDir

    assert not RunDir(out).shm().exists()  # tmpfs is memory: removed when the run ends


@pytest.mark.parametrize("replay", [False, True], ids=["no-r3", "r3"])
@pytest.mark.parametrize("model", ["glm5", "kimi", "qwen3-moe", "nemotron", "minimax"])
def test_every_model_trains_with_and_without_router_replay(model, replay, tmp_path):
    out = tmp_path / "run"
    flags = ["--trainer.router_replay"] if replay else []
    r = subprocess.run([sys.executable, "-m", "primerl.cli", "run", "--model", model, "--env", "reverse-text",
                        "--max-steps", "1", "--output-dir", str(out), *SMALL, *flags],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    (row,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # on-policy, float32 on both sides: the trainer routes as inference did, except where two
    # experts' scores tie within the rounding of different batch shapes (~1e-7; a few in a
    # million decisions, more on another CPU's kernels); without replay such a flip moves
    # that token's logprob too
    assert row["routing_agreement"] >= 0.99 and row["mismatch_kl"] < (1e-6 if replay else 1e-4)
    assert (out / "checkpoints" / "step_000001" / "config.json").exists()
    trainer_log = (out / "logs" / "trainer.log").read_text()
    assert "not replaying" not in trainer_log


def test_a_dense_model_trains_on_policy(tmp_path):
    """Qwen3 (dense): one step, on-policy in float32 (nothing routes); router replay is refused
    at config time, before any process starts."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "primerl.cli", "run", "--model", "qwen3", "--env", "reverse-text", "--max-steps", "1",
           "--output-dir", str(out), *SMALL]
    r = subprocess.run([*cmd, "--trainer.router_replay"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].endswith(
        "model 'qwen3' (preset 'tiny') does not support router replay: leave it off"), r.stdout + r.stderr
    assert not out.exists()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    (row,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert row["mismatch_kl"] < 1e-4
    assert (out / "checkpoints" / "step_000001" / "config.json").exists()


@pytest.mark.parametrize("arch,channel,nproc", [("llama", "shm", "1"), ("mixtral", "filesystem", "2")])
def test_a_transformers_checkpoint_trains_through_the_hf_model(arch, channel, nproc, tmp_path):
    """--model hf on a checkpoint transformers wrote (its own tokenizer and chat template):
    20 steps of reverse-text, on-policy at step 1 in float32, weight updates through either
    channel (filesystem: the published layout, converted back while loading), one trainer
    rank or FSDP2 over two, and the last weights load into transformers, changed."""
    import torch
    from hf_checkpoints import write_checkpoint
    from transformers import AutoModelForCausalLM

    ckpt = write_checkpoint(arch, tmp_path / "ckpt")
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "primerl.cli", "run", "--model", "hf", "--model.checkpoint", str(ckpt),
                        "--env", "reverse-text", "--max-steps", "20", "--trainer.weight_channel", channel,
                        "--trainer.nproc", nproc, "--output-dir", str(out)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, 21))
    assert abs(rows[0]["mismatch_kl"]) < 1e-3, rows[0]
    assert all(row["errors/rollout"] == 0 for row in rows)
    before = AutoModelForCausalLM.from_pretrained(ckpt).state_dict()
    after = AutoModelForCausalLM.from_pretrained(out / "checkpoints" / "step_000020").state_dict()
    assert before.keys() == after.keys()
    assert all(not torch.equal(before[n], after[n]) for n in before if n.endswith("_proj.weight") or "experts" in n)


@pytest.mark.parametrize("nproc", ["1", "2"])
def test_a_lora_run_publishes_merged_weights_checkpoints_a_peft_adapter_and_resumes(nproc, tmp_path):
    """--trainer.lora.rank 4 (one rank, or FSDP2 over two): an SFT warm-up of the model's own
    weights, RL steps of the adapters; a checkpoint every step; run again with more steps, it
    resumes. The last checkpoint's adapter, loaded by peft onto the checkpoint's frozen
    weights in transformers, gives the logits of the weights inference was sent."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "primerl.cli", "run", "--model", "qwen3", "--env", "reverse-text", "--output-dir",
           str(out), *SMALL, "--sft.steps", "3", "--trainer.lora.rank", "4", "--trainer.checkpoint_every", "1",
           "--trainer.nproc", nproc]
    r = subprocess.run([*cmd, "--max-steps", "2"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "random weights" not in r.stdout  # a warm-up is on
    r = subprocess.run([*cmd, "--max-steps", "3"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    log = (out / "logs" / "trainer.log").read_text()
    assert "lora: rank 4" in log and "resum" in log.lower(), log[-3000:]
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    ckpt = out / "checkpoints" / "step_000003"
    assert (ckpt / "adapter" / "adapter_config.json").is_file()
    ids = torch.arange(5, 40)[None]
    base = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    with torch.no_grad():
        frozen = base(input_ids=ids).logits
        adapted = PeftModel.from_pretrained(base, ckpt / "adapter").eval()(input_ids=ids).logits
        served = AutoModelForCausalLM.from_pretrained(out / "weights" / "step_000003")(input_ids=ids).logits
    # x(W + sBA) against xW + s(xA)B in float32: equal up to rounding (1e-5 seen at |logit| 0.63)
    torch.testing.assert_close(adapted, served, atol=1e-5, rtol=1e-4)
    assert (adapted - frozen).abs().max() > 1e-3  # the adapters moved, far past the rounding


def test_lora_learns_the_quick_start(tmp_path):
    """The first half of the quick start with ``--trainer.lora.rank 8`` (the default targets:
    every linear, the head and the routed experts) at a learning rate for adapters (3x the
    quick start's, as LoRA usually wants): the reward climbs (measured rises over 150 steps
    0.20, 0.22; at the quick start's lr 0.11, and 0.23 over its 300 steps; the bar leaves
    room for noise)."""
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "primerl.cli", "run", "--model", "glm5", "--env", "reverse-text",
                        "--trainer.lora.rank", "8", "--trainer.lr", "1.2e-3", "--max-steps", "150",
                        "--output-dir", str(out)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    rewards = [json.loads(line)["reward/mean"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last - first >= 0.12, (first, last)


@pytest.mark.parametrize("algorithm", [
    ["--trainer.loss", "grpo_clip"],  # PPO clipping (dapo and dr_grpo share it)
    ["--trainer.loss", "gspo"],  # a sequence-level ratio
    ["--trainer.loss", "cispo", "--trainer.correction", "tis"],  # REINFORCE weighted, with a correction
], ids=["grpo_clip", "gspo", "cispo+tis"])
def test_each_loss_family_learns_the_quick_start(tmp_path, algorithm):
    """The first half of the quick start with another loss family: each loss and correction
    was checked once at >= 0.2 over the quick start's 300 steps (docs/algorithms.md); over 150
    steps they rose 0.22 (grpo_clip), 0.18 (gspo) and 0.22 (cispo+tis), and the bar leaves
    room for noise."""
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "primerl.cli", "run", "--model", "glm5", "--env", "reverse-text",
                        *algorithm, "--max-steps", "150", "--output-dir", str(out)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rewards = [row["reward/mean"] for row in rows]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last - first >= 0.12, (first, last)
    if "--trainer.correction" in algorithm:
        assert all(0 < row["is_weight/mean"] <= row["is_weight/max"] <= 2.0 for row in rows)


def test_multi_turn_wordle_run_completes(tmp_path):
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "primerl.cli", "run", "--model", "glm5", "--env", "wordle",
                        "--max-steps", "2", "--output-dir", str(out)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2] and rows[0]["turns/mean"] > 1
    from primerl.rundir import RunDir
    from primerl.samples import read_batch

    for s in read_batch(RunDir(out).batch(1)).samples:  # token-exact: env turns carry no loss, model turns do
        assert len(s.tokens) == len(s.loss_mask) == len(s.logprobs)
        assert 0 < s.sampled_tokens < len(s.tokens)


@pytest.mark.skipif(__import__("shutil").which("bwrap") is None, reason="bubblewrap is not installed")
def test_swe_runs_as_typed(tmp_path, swe_cache):
    """`primerl run --model glm5 --env swe`: no task file, so the shipped set is built on first
    use (said in the log); every episode is set up, played and scored (no task errors)."""
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "primerl.cli", "run", "--model", "glm5", "--env", "swe",
                        "--max-steps", "2", "--output-dir", str(out), "--env.cache_dir", str(swe_cache)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    assert all(row["errors/task"] == 0 and row["errors/rollout"] == 0 and row["turns/mean"] >= 1 for row in rows), rows
    log = (out / "logs" / "orchestrator.log").read_text()
    assert "building the shipped task set 'pyutils'" in log or "made the environment of pyutils__" in log, log[-3000:]
    import tempfile

    leftovers = list(Path(tempfile.gettempdir(), "primerl-swe").glob("*/primerl-swe-*"))
    assert leftovers == []  # every scratch checkout was removed


def test_multi_turn_with_router_replay_ends_each_trajectory_on_a_model_turn(tmp_path):
    """alphabet-sort has 3 turns; with max_turns 2 the env still answers the second model
    turn, and that trailing env turn must not reach the trainer (R3 needs experts for every
    token it trains on)."""
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "primerl.cli", "run", "--model", "glm5", "--env", "alphabet-sort",
                        "--max-steps", "1", "--output-dir", str(out), "--env.max_turns", "2",
                        "--trainer.router_replay", "--orchestrator.max_tokens", "24"],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    from primerl.rundir import RunDir
    from primerl.samples import read_batch

    for s in read_batch(RunDir(out).batch(1)).samples:
        assert s.loss_mask[-1] == 1 and s.turns == 2
        assert s.routed_experts.shape[0] == len(s.tokens) - 1
    assert "not replaying" not in (out / "logs" / "trainer.log").read_text()


def test_a_swe_run_whose_tasks_cannot_be_set_up_stops_with_the_cause(tmp_path):
    """Every task's repository is unusable: the run must stop on its own, quickly, saying
    why in one line, instead of retrying rollouts forever."""
    (tmp_path / "not-a-repo").mkdir()
    record = {"instance_id": "broken-1", "repo": "not-a-repo", "base_commit": "HEAD", "problem_statement": "fix it",
              "patch": "", "test_patch": "", "FAIL_TO_PASS": ["test_x.py::test_x"], "PASS_TO_PASS": []}
    (tmp_path / "tasks.jsonl").write_text(json.dumps(record) + "\n")
    out = tmp_path / "run"
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "primerl.cli", "run", "--model", "glm5", "--env", "swe",
                        "--env.tasks", str(tmp_path / "tasks.jsonl"), "--env.sandbox", "rlimit", "--max-steps", "2",
                        "--output-dir", str(out)], capture_output=True, text=True, timeout=300)
    elapsed = time.monotonic() - t0
    assert r.returncode == 1, r.stdout + r.stderr
    assert elapsed < 120, elapsed
    assert "the orchestrator process exited with code 1" in r.stderr
    (cause,) = [line for line in r.stderr.splitlines() if "stopping the run" in line]
    assert "rollout groups failed" in cause and "not a git repository" in cause
    assert "Traceback" not in r.stderr


def test_fp8_training_and_inference_compute_the_same_numbers(tmp_path):
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "primerl.cli", "run", "--model", "qwen3-moe", "--env", "reverse-text",
                        "--max-steps", "1", "--output-dir", str(out), *SMALL, "--trainer.fp8", "true"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "fp8: block-scaled FP8 matmuls in" in (out / "logs" / "trainer.log").read_text()
    (row,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # on-policy: the engine runs the trainer's FP8 matmuls, so the logprobs agree to float
    # rounding. Not exactly: the engine's batch shapes differ from the trainer's, some CPUs'
    # kernels then round differently (5e-7 seen on CI), and a 1x128 activation tile's scale
    # can move with it.
    assert row["mismatch_kl"] < 1e-5 and row["routing_agreement"] >= 0.99, row


def test_a_mooncake_run_gets_its_master_from_the_launcher(tmp_path):
    pytest.importorskip("primerl_kv_mooncake", reason="the mooncake KV store plugin is not installed")
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "primerl.cli", "run", "--model", "glm5", "--env", "reverse-text",
                        "--max-steps", "2", "--output-dir", str(out), *SMALL, "--inference.replicas", "2",
                        "--inference.kv_store", "mooncake"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Mooncake master at 127.0.0.1:" in r.stdout
    # the master's address reached every server through the run-time record, not the environment
    runtime = json.loads((out / "runtime.json").read_text())
    assert runtime["kv_store_options"]["master"].startswith("127.0.0.1:") and len(runtime["inference_urls"]) == 2
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    assert (out / "logs" / "mooncake.log").exists()


def test_two_sources_train_together_by_ratio_with_their_own_metrics_and_evaluations(tmp_path):
    """examples/mixed.toml cut short: reverse-text and wordle at 3:1 in every batch, each
    source's reward in metrics.jsonl, the eval source evaluated on its own interval."""
    config = tmp_path / "mixed.toml"
    config.write_text((Path(__file__).parents[2] / "examples" / "mixed.toml").read_text()
                      .replace("every = 20", "every = 1").replace("tasks = 16", "tasks = 4"))
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "primerl.cli", "run", "--model", "glm5", "@", str(config),
                        "--max-steps", "3", "--sft.steps", "0", "--orchestrator.max_tokens", "8",
                        "--output-dir", str(out)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(row["samples/reverse"], row["samples/wordle"]) for row in rows] == [(48, 16)] * 3
    assert all(0 <= row["reward/reverse/mean"] <= 1 and 0 <= row["reward/wordle/mean"] <= 1 for row in rows)
    assert any("eval/wordle/reward/mean" in row for row in rows[1:])  # after batch 1 (and 2), with a later batch
    assert "reward 0." in r.stdout and "(reverse 0." in r.stdout  # the live view shows each source's reward


def test_two_runs_started_together_on_one_machine_each_hold_a_port_of_their_own(tmp_path):
    """Both ask for the default inference.port: the first to hold it keeps it for the whole run,
    the other holds a free one. (Found free and bound seconds later, the same port went to
    both, and one run's server failed to bind.)"""
    from primerl.runtime import read_runtime

    outs = [tmp_path / "a", tmp_path / "b"]
    procs = [subprocess.Popen([sys.executable, "-m", "primerl.cli", "run", "--model", "glm5", "--env", "reverse-text",
                               *SMALL, "--max-steps", "1", "--output-dir", str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for out in outs]
    ends = [p.communicate(timeout=600) for p in procs]
    for p, (stdout, stderr) in zip(procs, ends):
        assert p.returncode == 0, stdout + stderr
    urls = [read_runtime(out).inference_urls for out in outs]
    assert len(set(urls)) == 2 and all(len(u) == 1 for u in urls), urls
