"""``--model hf`` (transformers' modeling code) vs primerl's own plugin for the same weights.

The same tiny Qwen3 weights twice: built by the ``qwen3`` plugin, and saved as a
checkpoint that ``--model hf`` loads into transformers' ``Qwen3ForCausalLM``. Two
workloads, rounds alternating between the two models, medians compared:

* engine: 32 concurrent greedy requests (prompts of 8-64 tokens, 16-96 new tokens), the
  embedded engine's continuous batching, prefix cache emptied before each round;
* trainer: forward + backward over 4 packed rows of 512 tokens (sequences of 40-200).

    python bench/hf_model.py        # final line: {"engine_ratio": hf / plugin, "train_ratio": ...}
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from primerl_embedded.engine import Engine, SamplingParams

    from primerl.models import ModelConfig
    from primerl.registry import get_registry

    reg = get_registry()
    plugin = reg.load("model", "qwen3")()
    cfg = ModelConfig(name="qwen3", preset="tiny", seed=args.seed)
    ours = plugin.build(cfg)
    tok = plugin.tokenizer(cfg)
    with tempfile.TemporaryDirectory() as d:
        plugin.save_checkpoint(ours, d, tok)
        hf_adapter = reg.load("model", "hf")()
        theirs = hf_adapter.build(ModelConfig(name="hf", checkpoint=d))
    models = {"plugin": ours, "hf": theirs}

    rng = random.Random(args.seed)
    vocab = min(len(tok), 250)
    prompts = [[rng.randrange(10, vocab) for _ in range(rng.randint(8, 64))] for _ in range(args.requests)]
    new_tokens = [rng.randint(16, 96) for _ in range(args.requests)]
    useful = sum(new_tokens)
    engines = {}
    for name, m in models.items():
        m.eval()
        engines[name] = Engine(m, eos_token_ids=[tok.eos_token_id], max_batch_size=args.requests,
                               max_model_len=256, kv_slots=args.requests)
        engines[name].generate(prompts[0][:4], SamplingParams(max_tokens=2, temperature=0))  # warm-up

    def run_engine(engine: Engine) -> float:
        engine.reset_prefix_cache()
        t0 = time.perf_counter()
        seqs = [engine.submit(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0]
                for p, n in zip(prompts, new_tokens)]
        while engine.has_work():
            engine.step()
        assert sum(len(s.output_ids) for s in seqs) == useful
        return time.perf_counter() - t0

    # packed training rows: sequences of 40-200 tokens, 4 rows of 512
    S, rows = 512, 4
    ids = torch.zeros(rows, S, dtype=torch.long)
    pos, seg = torch.zeros_like(ids), torch.zeros_like(ids)
    lengths = torch.zeros(rows, dtype=torch.long)
    for r in range(rows):
        at, k = 0, 0
        while True:
            n = rng.randint(40, 200)
            if at + n > S:
                break
            ids[r, at:at + n] = torch.tensor([rng.randrange(10, vocab) for _ in range(n)])
            pos[r, at:at + n], seg[r, at:at + n] = torch.arange(n), k
            at, k = at + n, k + 1
        lengths[r] = at

    def run_train(m: torch.nn.Module) -> float:
        m.train()
        t0 = time.perf_counter()
        with torch.enable_grad():
            m(ids, pos, lengths, segment_ids=seg).logits.logsumexp(-1).mean().backward()
        m.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    engine_t: dict[str, list[float]] = {n: [] for n in models}
    train_t: dict[str, list[float]] = {n: [] for n in models}
    for m in models.values():
        run_train(m)  # warm-up
    for _ in range(args.rounds):
        for name in models:
            with torch.no_grad():
                models[name].eval()
                engine_t[name].append(run_engine(engines[name]))
            train_t[name].append(run_train(models[name]))
    med = {k: {n: statistics.median(v) for n, v in d.items()} for k, d in (("engine", engine_t), ("train", train_t))}
    for name in models:
        print(f"{name}: engine {useful / med['engine'][name]:.0f} tok/s (rounds {[round(t, 2) for t in engine_t[name]]} s), "
              f"train step {med['train'][name] * 1e3:.0f} ms (rounds {[round(t * 1e3) for t in train_t[name]]})")
    print(json.dumps({
        "bench": "hf_model", "requests": args.requests, "useful_tokens": useful,
        "engine_tokens_per_s": {n: round(useful / med["engine"][n], 1) for n in models},
        "train_step_ms": {n: round(med["train"][n] * 1e3, 1) for n in models},
        "engine_ratio": round(med["engine"]["plugin"] / med["engine"]["hf"], 2),  # hf throughput / plugin's
        "train_ratio": round(med["train"]["hf"] / med["train"]["plugin"], 2),  # hf step time / plugin's
    }))


if __name__ == "__main__":
    main()
