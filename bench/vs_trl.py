"""primerl vs TRL's GRPOTrainer: rollouts trained per second, same model, task and machine.

Model: the tiny GLM-5 preset (HF ``glm_moe_dsa``: hidden 128, 4 layers, 8 routed experts,
top-2), the same initial weights in both. Task: reverse-text (single words, reward = LCS
ratio), 8 prompts x 8 samples a step, at most 24 new tokens, temperature 1, no SFT.
TRL runs its GRPOTrainer on the CPU (HF ``generate``, synchronous); primerl runs
``primerl run`` (its engine, orchestrator and trainer as three processes, async level 1).
Both are timed between the end of their first step and the end of their last, so start-up
(imports, process launch) is excluded from both.

    pip install -r requirements-bench.txt   # trl
    python bench/vs_trl.py                   # final line: {"ratio": primerl / trl, ...}
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

SAMPLES_PER_STEP = 64
GROUP = 8
MAX_NEW = 24


def primerl_rollouts_per_s(out: Path, steps: int) -> float:
    cmd = [sys.executable, "-m", "primerl.cli", "run", "--model", "glm5", "--env", "reverse-text",
           "--output-dir", str(out), "--max-steps", str(steps + 1), "--sft.steps", "0", "--env.max_words", "1",
           "--orchestrator.batch_size", str(SAMPLES_PER_STEP), "--orchestrator.group_size", str(GROUP),
           "--orchestrator.max_tokens", str(MAX_NEW), "--orchestrator.temperature", "1.0",
           "--orchestrator.async_level", "1"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, timeout=1800)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    stamps = [r["time/end"] for r in rows]
    return SAMPLES_PER_STEP * (len(stamps) - 1) / (stamps[-1] - stamps[0])


def trl_rollouts_per_s(out: Path, steps: int) -> float:
    import torch
    from datasets import Dataset
    from primerl_reverse_text.env import ReverseText, ReverseTextConfig, lcs_ratio
    from transformers import AutoConfig, AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from primerl.models import ModelConfig
    from primerl.registry import get_registry

    adapter = get_registry().load("model", "glm5")()
    cfg = ModelConfig(name="glm5", preset="tiny", seed=0)
    ours = adapter.build(cfg)
    tok = adapter.tokenizer(cfg)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**adapter.hf_config("tiny")),
                                             attn_implementation="eager")
    model.load_state_dict(ours.state_dict(), strict=False)

    env = ReverseText(ReverseTextConfig(max_words=1, num_train=2000))
    tasks = list(env.tasks("train"))
    data = Dataset.from_list([{"prompt": t.messages(), "answer": t.answer} for t in tasks])

    def reward(completions, answer, **_):
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
    )
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data,
                          processing_class=tok, callbacks=[Clock()])
    torch.set_num_threads(os.cpu_count() or 2)
    trainer.train()
    return SAMPLES_PER_STEP * (len(stamps) - 1) / (stamps[-1] - stamps[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    try:
        import trl  # noqa: F401
    except ImportError:
        sys.exit("this benchmark needs TRL: pip install -r requirements-bench.txt")
    with tempfile.TemporaryDirectory() as tmp:
        ours = primerl_rollouts_per_s(Path(tmp) / "primerl", args.steps)
        theirs = trl_rollouts_per_s(Path(tmp) / "trl", args.steps)
    print(f"primerl: {ours:.1f} rollouts/s; TRL GRPOTrainer: {theirs:.1f} rollouts/s")
    print(json.dumps({"bench": "vs_trl", "steps": args.steps, "samples_per_step": SAMPLES_PER_STEP,
                      "primerl_rollouts_per_s": round(ours, 2), "trl_rollouts_per_s": round(theirs, 2),
                      "ratio": round(ours / theirs, 2)}))


if __name__ == "__main__":
    main()
