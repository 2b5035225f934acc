"""Trainer step on packed rows: attention one sequence per row vs masked whole rows.

The trainer packs variable-length samples into rows of ``trainer.seq_len`` tokens. Masked
attention over a whole row costs (row length)^2 per row whatever it holds; running
attention (and the DSA indexer) one sequence per row, as varlen attention kernels do,
costs each sequence's own length squared. Both layouts give the same numbers (tests/models
check it for every architecture); this measures the time of one full optimizer step
(forward, backward, AdamW) on the same batch, side by side, for two workloads:

* ``short``: 64 samples of ~50 tokens in 128-token rows (the quick start, bench/vs_trl.py);
* ``multi-turn``: 48 samples of 155-310 tokens in 2048-token rows (a multi-turn env's episodes).

    python bench/packed_attention.py    # final line: {"ratio": {workload: masked / per-sequence seconds}}
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

WORKLOADS = {"short": (64, 50, 24, 128), "multi-turn": (48, 250, 60, 2048)}  # samples, prompt, completion, seq_len


def samples(n: int, prompt: int, completion: int, seed: int) -> list:
    from primerl.samples import Sample

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p, c = rng.randint(prompt // 2, prompt), rng.randint(completion // 2, completion)
        out.append(Sample(tokens=[rng.randrange(256) for _ in range(p + c)], loss_mask=[0] * p + [1] * c,
                          logprobs=[0.0] * p + [-1.0] * c, versions=[-1] * p + [0] * c,
                          advantage=rng.gauss(0, 1), reward=0.5))
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

    torch.set_num_threads(1)  # as in `primerl run` on 2 cores: the trainer gets one
    ratios = {}
    for name, (n, prompt, completion, seq_len) in WORKLOADS.items():
        cfg = load_config(ConfigSources(overrides=[("model.name", args.model), ("env.name", "reverse-text"),
                                                   ("trainer.seq_len", seq_len)]))
        _, model, _ = build_model(cfg)
        batch = samples(n, prompt, completion, seed=0)
        loss_fn = build_loss(cfg.trainer.loss, cfg.trainer.loss_options)
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.rounds):  # alternate, so drift in machine speed hits both alike
            for unpack in (False, True):
                model.unpack_segments = unpack
                optimizer = make_optimizer(model, 0.0, 0.0)  # lr 0: every round sees the same weights
                t0 = time.perf_counter()
                rl_step(model, optimizer, pack(batch, seq_len), loss_fn, cfg, load_parallelism("single"))
                times[unpack].append(time.perf_counter() - t0)
        masked, per_seq = statistics.median(times[False]), statistics.median(times[True])
        ratios[name] = round(masked / per_seq, 2)
        print(json.dumps({"workload": name, "tokens": sum(len(s.tokens) for s in batch), "seq_len": seq_len,
                          "masked_rows_s": round(masked, 3), "per_sequence_s": round(per_seq, 3),
                          "ratio": ratios[name]}), flush=True)
    print(json.dumps({"bench": "packed_attention", "model": args.model, "ratio": ratios}))


if __name__ == "__main__":
    main()
