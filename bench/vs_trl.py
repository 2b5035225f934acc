"""primerl vs TRL's GRPOTrainer: rollouts trained per second, same model, task and machine.

Model: the tiny GLM-5 preset (HF ``glm_moe_dsa``: hidden 128, 4 layers, 8 routed experts,
top-2), the same initial weights in both. Task: reverse-text (single words, reward = LCS
ratio), 8 prompts x 8 samples a step, at most 24 new tokens, temperature 1, no SFT.
TRL runs its GRPOTrainer on the CPU (HF ``generate``, then one optimizer step, synchronous);
primerl runs ``primerl run`` (its engine, orchestrator and trainer as three
processes, async level 1). Both are timed between the end of their first step and the end
of their last, so start-up (imports, process launch) is excluded from both.

TRL runs at its best: without gradient checkpointing (TRL 1.16 turns it on by default,
which recomputes every forward in the backward); with the faster of 1 and all torch
threads, chosen in each round by a short probe (3 steps each; on a shared machine a second
OpenMP thread can make TRL ten times slower, and the load changes from minute to minute);
and with HF's ``eager`` and ``sdpa`` attention, the faster median being the one compared.
Rounds alternate primerl and the two TRL runs (each in a process of its own), so drift in
the machine's speed hits all alike; the ratio is median primerl / best TRL median.

Also reported, to tell how close the trainer is to the machine:

* ``trainer_gflops``: the trainer's useful FLOPs per second, 6 x active parameters x
  trained tokens per step / ``time/train`` (the trainer's own time per step, batch in hand
  to weights published; medians). Active parameters are those a token's forward multiplies
  by: routed experts count top_k / E, the embedding table and the DSA indexer (no
  gradient) do not count.
  Trained tokens are the samples' own positions (what TRL computes); with shared prompts
  (``trainer.share_prompts``) the trainer computes fewer, ``computed_tokens_per_step``,
  so this rate counts the work a whole-sample trainer would have done.
* ``matmul_gflops``: one core's float32 matmul rate on the trainer's shapes
  ([8 x 128 tokens, hidden] @ [hidden, 128 or 256]), measured in this process
  between the rounds (median).
* ``cpu_s_per_step``: CPU seconds per step of each primerl process (when psutil is
  installed; TRL and accelerate bring it).
* ``off_policy_mean``: how many policy versions the trained samples lag, on average
  (``off_policy/mean`` in metrics.jsonl): about ``async_level``.

primerl runs at ``orchestrator.async_level`` 1 by default (prime-rl's fixed depth);
``--primerl-args`` adds ``primerl run`` options, e.g. a deeper pipeline whose engine
decodes two steps' samples at once (its cost per rollout falls with the batch: per-op
overhead is most of a decode step at 64 rows on a CPU):

    pip install -r requirements-bench.txt   # trl
    python bench/vs_trl.py                   # final line: {"ratio": primerl / trl, ...}
    python bench/vs_trl.py --primerl-args "--orchestrator.async_level 2 --inference.max_batch_size 128 --inference.kv_slots 256"
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SAMPLES_PER_STEP = 64
GROUP = 8
MAX_NEW = 24
ROWS, SEQ_LEN = 8, 128  # matmul_gflops' shapes: [ROWS x SEQ_LEN, hidden], rows of the quick start's seq_len


def primerl_run(out: Path, steps: int, extra: list[str] = ()) -> dict:
    """One ``primerl run`` (``extra``: more of its options): rollouts/s, the trainer's median
    time/train and trained tokens per step, the samples' mean policy lag (``off_policy/mean``)
    and each process's CPU seconds per step (psutil, if installed)."""
    cmd = [sys.executable, "-m", "primerl.cli", "run", "--model", "glm5", "--env", "reverse-text",
           "--output-dir", str(out), "--max-steps", str(steps + 1), "--sft.steps", "0", "--env.max_words", "1",
           "--orchestrator.batch_size", str(SAMPLES_PER_STEP), "--orchestrator.group_size", str(GROUP),
           "--orchestrator.max_tokens", str(MAX_NEW), "--orchestrator.temperature", "1.0",
           "--orchestrator.async_level", "1",
           "--inference.port", "0",  # any free port: another run on this machine may hold 8000
           *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    metrics = out / "metrics.jsonl"
    cpu: list[dict[str, float]] = []  # per-process CPU seconds at the end of step 1 and of the last step
    deadline = time.time() + 1800
    while proc.poll() is None and time.time() < deadline:
        done = len(metrics.read_text().splitlines()) if metrics.exists() else 0
        if (done >= 1 and not cpu) or (done >= steps + 1 and len(cpu) == 1):
            cpu.append(_cpu_seconds(proc.pid))
        time.sleep(0.02)
    if proc.poll() is None:
        proc.kill()
    if proc.wait() != 0:
        raise SystemExit(f"primerl run failed (exit {proc.returncode}); see {out / 'logs'}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    stamps = [r["time/end"] for r in rows]
    trained = rows[1:]  # the steps between the first one's end and the last one's
    result = {
        "rollouts_per_s": SAMPLES_PER_STEP * (len(stamps) - 1) / (stamps[-1] - stamps[0]),
        "train_s": statistics.median(r["time/train"] for r in trained),
        "tokens": statistics.median(SAMPLES_PER_STEP * (r["seq_len/mean"] - 1) for r in trained),
        "computed": statistics.median(r["trainer/tokens"] for r in trained),
        "off_policy": statistics.mean(r["off_policy/mean"] for r in trained),
    }
    if len(cpu) == 2 and cpu[0]:
        result["cpu"] = {k: (cpu[1][k] - cpu[0][k]) / (len(stamps) - 1) for k in cpu[0] if k in cpu[1]}
    return result


def _cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of the run's trainer, inference and orchestrator processes."""
    try:
        import psutil
    except ImportError:
        return {}
    seconds: dict[str, float] = {}
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return {}
    for child in children:
        try:
            args = child.cmdline()
            kind = next((a for a in args if a in ("trainer", "inference", "orchestrator")), None)
            if kind is not None:
                t = child.cpu_times()
                seconds[kind] = seconds.get(kind, 0.0) + t.user + t.system
        except psutil.Error:
            continue
    return seconds


def trl_run(out: Path, steps: int, attn: str, threads: int, preset: str = "tiny") -> float:
    """One TRL run in a process of its own (``--trl-only``): rollouts/s."""
    return trl_run_stats(out, steps, attn, threads, preset)["rollouts_per_s"]


def trl_run_stats(out: Path, steps: int, attn: str, threads: int, preset: str = "tiny") -> dict:
    """One TRL run in a process of its own: rollouts/s and the prompt and completion tokens
    of its timed steps (what :func:`trl_rollouts_per_s` returns)."""
    cmd = [sys.executable, __file__, "--trl-only", attn, "--trl-threads", str(threads), "--steps", str(steps),
           "--out", str(out), "--preset", preset]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"the TRL run failed (exit {done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def trl_rollouts_per_s(out: Path, steps: int, attn: str, threads: int, preset: str = "tiny") -> dict:
    """TRL's GRPOTrainer on ``preset`` of GLM-5: rollouts/s between the end of its first step
    and of its last, and the mean prompt and completion tokens of a timed step."""
    import torch
    from datasets import Dataset
    from primerl_reverse_text.env import ReverseText, ReverseTextConfig, lcs_ratio
    from transformers import AutoConfig, AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from primerl.models import ModelConfig
    from primerl.registry import get_registry

    adapter = get_registry().load("model", "glm5")()
    cfg = ModelConfig(name="glm5", preset=preset, seed=0)
    ours = adapter.build(cfg)
    tok = adapter.tokenizer(cfg)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**adapter.hf_config(preset)),
                                             attn_implementation=attn)
    model.load_state_dict(ours.state_dict(), strict=False)

    env = ReverseText(ReverseTextConfig(max_words=1, num_train=2000))
    tasks = list(env.tasks("train"))
    data = Dataset.from_list([{"prompt": t.messages(), "answer": t.answer} for t in tasks])

    tokens: list[tuple[int, int]] = []  # per reward call (one step's batch): (prompt, completion) tokens
    prompt_len = {t.answer: len(tok.apply_chat_template(t.messages(), add_generation_prompt=True)) for t in tasks}

    def reward(completions, answer, completion_ids=None, **_):
        done = sum(map(len, completion_ids)) if completion_ids is not None else 0
        tokens.append((sum(prompt_len[a] for a in answer), done))
        return [lcs_ratio(c[0]["content"].strip() if isinstance(c, list) else c.strip(), a)
                for c, a in zip(completions, answer)]

    stamps: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.time())

    args = GRPOConfig(
        output_dir=str(out), max_steps=steps + 1, per_device_train_batch_size=SAMPLES_PER_STEP,
        num_generations=GROUP, max_completion_length=MAX_NEW, temperature=1.0, learning_rate=1e-3,
        use_cpu=True, report_to=[], logging_steps=1000, save_strategy="no", beta=0.0, bf16=False,
        dataloader_num_workers=0, seed=0,
        gradient_checkpointing=False,  # TRL 1.16 turns it on by default: saves memory, recomputes forwards
    )
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data,
                          processing_class=tok, callbacks=[Clock()])
    torch.set_num_threads(threads)
    trainer.train()
    timed = tokens[1:] or tokens
    return {"rollouts_per_s": SAMPLES_PER_STEP * (len(stamps) - 1) / (stamps[-1] - stamps[0]),
            "prompt_tokens_per_step": statistics.mean(p for p, _ in timed),
            "completion_tokens_per_step": statistics.mean(c for _, c in timed)}


def matmul_gflops(repeat: int = 5) -> float:
    """One core's float32 matmul rate (GFLOP/s) on the trainer's forward shapes: [ROWS x
    SEQ_LEN, 128] @ [128, 128] and @ [128, 256] (the tiny preset's hidden 128 to its
    projections and MLP), best of ``repeat`` timings of 20 products each."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = torch.randn(ROWS * SEQ_LEN, 128)
        ws = [torch.randn(128, 128), torch.randn(128, 256)]
        flops = sum(2 * x.shape[0] * 128 * w.shape[1] for w in ws) * 20
        best = float("inf")
        for _ in range(repeat):
            t0 = time.perf_counter()
            for _ in range(20):
                for w in ws:
                    x @ w
            best = min(best, time.perf_counter() - t0)
        return flops / best / 1e9
    finally:
        torch.set_num_threads(threads)


def active_params(preset: str = "tiny") -> int:
    """Parameters a token's forward multiplies by (see the module docstring)."""
    from primerl.models import ModelConfig
    from primerl.models.experts import Experts
    from primerl.registry import get_registry

    model = get_registry().load("model", "glm5")().build(ModelConfig(name="glm5", preset=preset, seed=0))
    k = model.config.num_experts_per_tok
    skip = {id(model.input_embeddings().weight)}
    skip |= {id(p) for n, p in model.named_parameters() if ".indexer." in n}
    total = 0
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if id(p) in skip:
                continue
            skip.add(id(p))
            total += p.numel() * k // p.shape[0] if isinstance(module, Experts) else p.numel()
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--primerl-args", default="", help="more `primerl run` options, e.g. "
                    "'--orchestrator.async_level 2 --inference.max_batch_size 128 --inference.kv_slots 256'")
    ap.add_argument("--trl-only", choices=("eager", "sdpa"), help=argparse.SUPPRESS)  # one TRL run (a child)
    ap.add_argument("--trl-threads", type=int, default=os.cpu_count() or 2, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--preset", default="tiny", help=argparse.SUPPRESS)  # the TRL child's preset
    args = ap.parse_args()
    try:
        import trl
    except ImportError:
        sys.exit("this benchmark needs TRL: pip install -r requirements-bench.txt")
    if args.trl_only:
        print(json.dumps(trl_rollouts_per_s(args.out, args.steps, args.trl_only, args.trl_threads, args.preset)))
        return

    ours: list[dict] = []
    theirs: dict[str, list[float]] = {"eager": [], "sdpa": []}  # per attention, each round's rollouts/s
    chosen: list[int] = []  # TRL's torch threads in each round
    rates = [matmul_gflops()]
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            ours.append(primerl_run(Path(tmp) / f"primerl{r}", args.steps, shlex.split(args.primerl_args)))
            rates.append(matmul_gflops())
            probe = {t: trl_run(Path(tmp) / f"probe{t}_{r}", 3, "eager", t) for t in sorted({1, os.cpu_count() or 1})}
            chosen.append(max(probe, key=lambda t: probe[t]))
            for attn in theirs:
                theirs[attn].append(trl_run(Path(tmp) / f"trl_{attn}_{r}", args.steps, attn, chosen[-1]))
            rates.append(matmul_gflops())
            print(f"round {r + 1}: primerl {ours[-1]['rollouts_per_s']:.1f} rollouts/s (trainer "
                  f"{ours[-1]['train_s']:.3f} s a step); TRL with {chosen[-1]} threads (probe "
                  f"{ {t: round(v, 1) for t, v in probe.items()} }): eager {theirs['eager'][-1]:.1f}, "
                  f"sdpa {theirs['sdpa'][-1]:.1f}", flush=True)

    primerl = statistics.median(o["rollouts_per_s"] for o in ours)
    best = max(theirs, key=lambda a: statistics.median(theirs[a]))
    trl = statistics.median(theirs[best])
    train_s = statistics.median(o["train_s"] for o in ours)
    tokens = statistics.median(o["tokens"] for o in ours)
    active = active_params()
    result = {
        "bench": "vs_trl", "steps": args.steps, "rounds": args.rounds, "samples_per_step": SAMPLES_PER_STEP,
        **({"primerl_args": args.primerl_args} if args.primerl_args else {}),
        "primerl_rollouts_per_s": round(primerl, 2), "trl_rollouts_per_s": round(trl, 2),
        "trl_attn": best, "trl_threads_by_round": chosen,
        "trl_rollouts_per_s_by_attn": {a: round(statistics.median(v), 2) for a, v in theirs.items()},
        "trainer_s_per_step": round(train_s, 3), "trained_tokens_per_step": round(tokens),
        "computed_tokens_per_step": round(statistics.median(o["computed"] for o in ours)),
        "active_params": active, "trainer_gflops": round(6 * active * tokens / train_s / 1e9, 1),
        "matmul_gflops": round(statistics.median(rates), 1),
        "off_policy_mean": round(statistics.median(o["off_policy"] for o in ours), 2),
    }
    cpus = [o["cpu"] for o in ours if o.get("cpu")]
    if cpus:
        result["cpu_s_per_step"] = {k: round(statistics.median(c.get(k, 0.0) for c in cpus), 3) for k in cpus[0]}
    result["ratio"] = round(primerl / trl, 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
