"""Embedded engine vs HF ``generate``: generated tokens per second, side by side.

Workload: 64 concurrent requests of mixed lengths (prompts of 8-64 tokens, 16-128 new
tokens each), greedy, on the tiny GLM-5 preset, float32, same weights in both. HF gets
its best shot at throughput: one left-padded batch of all 64 prompts, generating until
the longest request is done; only the tokens each request asked for are counted. The
engine runs the same 64 requests with continuous batching, its prefix cache emptied
before each round (no prompt is served from the previous round's cache). Nine
alternating rounds, medians compared: on a shared machine a round of either can be
slowed by tens of percent, the engine's short rounds of small ops more often.

    python bench/engine_vs_hf.py            # final line: {"ratio": engine / hf, ...}
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()

    from primerl_embedded.engine import Engine, SamplingParams
    from transformers import AutoConfig, AutoModelForCausalLM

    from primerl.models import ModelConfig
    from primerl.registry import get_registry

    torch.set_grad_enabled(False)
    adapter = get_registry().load("model", "glm5")()
    cfg = ModelConfig(name="glm5", preset="tiny", seed=args.seed)
    model = adapter.build(cfg).eval()
    tok = adapter.tokenizer(cfg)
    vocab = len(tok)

    rng = random.Random(args.seed)
    prompts = [[rng.randrange(10, min(vocab, 250)) for _ in range(rng.randint(8, 64))] for _ in range(args.requests)]
    new_tokens = [rng.randint(16, 128) for _ in range(args.requests)]
    useful = sum(new_tokens)

    # --- engine ---------------------------------------------------------------------------
    engine = Engine(model, eos_token_ids=[tok.eos_token_id], max_batch_size=args.requests,
                    max_model_len=256, kv_slots=args.requests)
    engine.generate(prompts[0][:4], SamplingParams(max_tokens=2, temperature=0))  # warm-up

    def run_engine() -> float:
        engine.reset_prefix_cache()  # every round starts cold: no prompt is served from the last one's cache
        t0 = time.perf_counter()
        seqs = [engine.submit(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0]
                for p, n in zip(prompts, new_tokens)]
        while engine.has_work():
            engine.step()
        assert sum(len(s.output_ids) for s in seqs) == useful
        return time.perf_counter() - t0

    # --- HF generate -----------------------------------------------------------------------
    hf_cfg = AutoConfig.for_model(**adapter.hf_config(cfg.preset))
    hf = AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager").eval()
    hf.load_state_dict(model.state_dict(), strict=False)
    width = max(len(p) for p in prompts)
    pad = tok.pad_token_id
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as HF generate needs for decoder-only models
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    hf.generate(ids[:1, -4:], attention_mask=mask[:1, -4:], max_new_tokens=2, do_sample=False, pad_token_id=pad)

    def run_hf() -> float:
        t0 = time.perf_counter()
        hf.generate(ids, attention_mask=mask, max_new_tokens=max(new_tokens), do_sample=False,
                    pad_token_id=pad, eos_token_id=None)
        return time.perf_counter() - t0

    # alternate the two, several rounds, and compare medians: a shared machine's speed
    # drifts by tens of percent from one minute to the next
    engine_times, hf_times = [], []
    for _ in range(args.rounds):
        engine_times.append(run_engine())
        hf_times.append(run_hf())
    t_engine, t_hf = statistics.median(engine_times), statistics.median(hf_times)

    engine_tps, hf_tps = useful / t_engine, useful / t_hf
    print(f"engine: {useful} tokens in {t_engine:.2f}s (median of {[round(t, 2) for t in engine_times]}) "
          f"= {engine_tps:.0f} tok/s")
    print(f"hf generate: {useful} useful tokens in {t_hf:.2f}s (median of {[round(t, 2) for t in hf_times]}) "
          f"= {hf_tps:.0f} tok/s")
    print(json.dumps({"bench": "engine_vs_hf", "requests": args.requests, "useful_tokens": useful,
                      "engine_tokens_per_s": round(engine_tps, 1), "hf_tokens_per_s": round(hf_tps, 1),
                      "ratio": round(engine_tps / hf_tps, 2)}))


if __name__ == "__main__":
    main()
