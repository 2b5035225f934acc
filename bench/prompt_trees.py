"""Trainer step with each group's prompt packed once (prompt trees) vs every sample whole.

GRPO samples come in groups that share their prompt. ``trainer.share_prompts`` packs a
group's prompt once per row and each sample's own positions after it (see
``primerl.trainer.packing``); the logprobs and gradients are the same as with whole
samples (tests/trainer/test_prompt_trees.py), so the two layouts do the same work but
compute different numbers of positions. This times one full optimizer step (forward,
backward, AdamW with lr 0, so every round sees the same weights) on the same batch in
both layouts, alternating, one torch thread (what the trainer gets in ``primerl run`` on
2 cores), for three workloads (groups x group size, prompt tokens, completion tokens,
``trainer.seq_len``):

* ``reverse-text``: 8 x 8, prompts of 18-22 tokens, completions of 20-24 (bench/vs_trl.py);
* ``learned``: the same prompts, completions of 3-8 tokens (the quick start once it has learned);
* ``agentic``: 4 x 8, prompts of 1,200-1,600 tokens (a tool-using agent's instructions
  and tools), completions of 100-300 tokens, rows of 4,096, one row per forward.

    python bench/prompt_trees.py    # final line: {"ratio": {workload: whole / trees seconds}}
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

# groups, group size, (prompt min, max), (completion min, max), seq_len, rows per forward
WORKLOADS = {
    "reverse-text": (8, 8, (18, 22), (20, 24), 128, 32),
    "learned": (8, 8, (18, 22), (3, 8), 128, 32),
    "agentic": (4, 8, (1200, 1600), (100, 300), 4096, 1),
}


def groups(n_groups: int, size: int, prompt: tuple[int, int], completion: tuple[int, int], seed: int) -> list:
    """``n_groups`` groups of ``size`` samples; a group's samples share a random prompt."""
    from primerl.samples import Sample

    rng = random.Random(seed)
    out = []
    for _ in range(n_groups):
        p = [rng.randrange(256) for _ in range(rng.randint(*prompt))]
        for _ in range(size):
            c = rng.randint(*completion)
            out.append(Sample(tokens=p + [rng.randrange(256) for _ in range(c)], loss_mask=[0] * len(p) + [1] * c,
                              logprobs=[0.0] * len(p) + [-1.0] * c, advantage=rng.gauss(0, 1), reward=0.5))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="glm5")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    from primerl.algorithms import build_loss
    from primerl.config import ConfigSources, load_config
    from primerl.trainer.main import build_model, load_parallelism
    from primerl.trainer.optim import make_optimizer
    from primerl.trainer.packing import pack
    from primerl.trainer.step import rl_step

    torch.set_num_threads(1)
    ratios = {}
    for name, (n_groups, size, prompt, completion, seq_len, rows) in WORKLOADS.items():
        cfg = load_config(ConfigSources(overrides=[("model.name", args.model), ("env.name", "reverse-text"),
                                                   ("trainer.seq_len", seq_len), ("trainer.micro_batch_rows", rows)]))
        _, model, _ = build_model(cfg)
        batch = groups(n_groups, size, prompt, completion, seed=0)
        loss_fn = build_loss(cfg.trainer.loss, cfg.trainer.loss_options)
        packed = {share: pack(batch, seq_len, share_prompts=share) for share in (False, True)}
        times: dict[bool, list[float]] = {True: [], False: []}
        for r in range(args.rounds + 1):  # the first round warms up; then alternate, so drift hits both alike
            for share in (False, True):
                optimizer = make_optimizer(model, 0.0, 0.0)
                t0 = time.process_time()
                rl_step(model, optimizer, pack(batch, seq_len, share_prompts=share), loss_fn, cfg,
                        load_parallelism("single"))
                if r:
                    times[share].append(time.process_time() - t0)
        whole, trees = statistics.median(times[False]), statistics.median(times[True])
        ratios[name] = round(whole / trees, 2)
        print(json.dumps({"workload": name, "samples": len(batch), "seq_len": seq_len,
                          "positions": {"whole": packed[False].num_tokens, "trees": packed[True].num_tokens},
                          "rows": {"whole": packed[False].num_rows, "trees": packed[True].num_rows},
                          "whole_s": round(whole, 3), "trees_s": round(trees, 3), "ratio": ratios[name]}), flush=True)
    print(json.dumps({"bench": "prompt_trees", "model": args.model, "rounds": args.rounds, "ratio": ratios}))


if __name__ == "__main__":
    main()
