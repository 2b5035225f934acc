"""``--model hf`` (transformers' modeling code) vs primerl's own plugin for the same weights.

Two workloads, rounds alternating between the two models, medians compared:

* engine: concurrent greedy requests (EOS ignored) through the embedded engine's continuous
  batching, prefix cache emptied before each round;
* trainer: forward + backward over packed training rows.

Default: the tiny Qwen3 preset, built by the ``qwen3`` plugin and saved as a checkpoint that
``--model hf`` loads into transformers' ``Qwen3ForCausalLM``; 32 requests (prompts of 8-64
random tokens, 16-96 new tokens), 4 packed rows of 512 tokens (random sequences of 40-200).

``--checkpoint C`` (a packaged checkpoint, a GGUF file or an HF folder; with ``--model`` the
plugin that implements it): both sides load that checkpoint, and the workloads are a real
run's. Engine: 32 chat prompts of reverse-text and alphabet-sort rendered with the model's
chat template (34-57 tokens), 16-96 new tokens. Trainer: what the trainer runs for a step
of each env, through its own code (``pack`` with prompt trees into rows of ``--seq-len``,
``micro_batches`` of 32 rows, ``row_forward`` with the head only at the loss's positions);
a plugin with ``varlen_rows`` gets each forward's rows joined into one row without padding,
as the trainer does (``join_rows``), ``--model hf`` the padded rows. Steps: reverse-text
as examples/smollm2-reverse-text.toml trains it (4 groups of 8: prompt, 3-24 completion
tokens), alphabet-sort as examples/smollm2-alphabet-sort.toml (4 groups of 4 three-turn
episodes: 3 names a turn, the sorted list answered each turn).

    python bench/hf_model.py        # final line: {"engine_ratio": hf / plugin, "train_ratio": ...}
    python bench/hf_model.py --model llama --checkpoint smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time

import torch


def random_rows(rng: random.Random, vocab: int, S: int = 512, rows: int = 4) -> dict[str, torch.Tensor]:
    """The tiny preset's rows: random sequences of 40-200 tokens packed into ``rows`` rows of ``S``."""
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
    return {"input_ids": ids, "positions": pos, "lengths": lengths, "segment_ids": seg}


def chat_ids(tok, messages: list[dict], generation_prompt: bool) -> list[int]:
    ids = tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def rl_samples(tok, env_name: str, seed: int) -> list:
    """A step's samples as the orchestrator hands them to the trainer: each group's samples
    share their prompt (the chat template's rendering), completions end with the end-of-turn
    token, loss on the model's own tokens only."""
    from primerl.registry import get_registry
    from primerl.samples import Sample

    rng = random.Random(seed)
    reg = get_registry()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    samples = []
    if env_name == "reverse-text":  # examples/smollm2-reverse-text.toml: batch 32, group 8, max 24 tokens
        env_cls = reg.load("env", "reverse-text")
        env = env_cls(env_cls.Config(words="english", seed=seed))
        for task in list(env.tasks("train"))[:4]:
            prompt = chat_ids(tok, task.messages(env.system_prompt), True)
            answer = tok.encode(task.answer, add_special_tokens=False)
            for _ in range(8):  # completions of 3-24 tokens: the answer, cut or run on
                n = rng.randint(3, 24)
                completion = ((answer + [end]) * 4)[: n - 1] + [end]
                samples.append(Sample(tokens=prompt + completion, loss_mask=[0] * len(prompt) + [1] * len(completion),
                                      advantage=rng.gauss(0, 1), task_id=task.id))
        return samples
    # examples/smollm2-alphabet-sort.toml: batch 16, group 4, three turns, max 48 tokens a turn
    env_cls = reg.load("env", "alphabet-sort")
    env = env_cls(env_cls.Config(seed=seed))
    for task in list(env.tasks("train"))[:4]:
        for _ in range(4):
            messages = task.messages(env.system_prompt)
            batches, tokens, mask = task.info["batches"], [], []
            for t in range(len(batches)):
                names = sorted(n for b in batches[: t + 1] for n in b)
                if rng.random() < 0.3:  # some answers wrong
                    rng.shuffle(names)
                before = chat_ids(tok, messages, True)
                messages = [*messages, {"role": "assistant", "content": ", ".join(names)}]
                after = chat_ids(tok, messages, False)[:-1]  # the answer up to its <|im_end|> (not the newline)
                tokens, mask = after, mask + [0] * (len(before) - len(mask)) + [1] * (len(after) - len(before))
                if t + 1 < len(batches):
                    messages.append({"role": "user",
                                     "content": f"Add: {', '.join(batches[t + 1])}. Give the whole list, sorted."})
            samples.append(Sample(tokens=tokens, loss_mask=mask, advantage=rng.gauss(0, 1), task_id=task.id))
    return samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3", help="the plugin compared with --model hf")
    ap.add_argument("--checkpoint", default=None, help="a packaged checkpoint, a GGUF file or an HF folder "
                                                       "(default: the plugin's tiny preset, random weights)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seq-len", type=int, default=512, help="trainer.seq_len (--checkpoint)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from primerl_embedded.engine import Engine, SamplingParams

    from primerl.models import ModelConfig
    from primerl.registry import get_registry

    reg = get_registry()
    plugin = reg.load("model", args.model)()
    hf_adapter = reg.load("model", "hf")()
    rng = random.Random(args.seed)
    if args.checkpoint is None:
        cfg = ModelConfig(name=args.model, preset="tiny", seed=args.seed)
        ours = plugin.build(cfg)
        tok = plugin.tokenizer(cfg)
        with tempfile.TemporaryDirectory() as d:
            plugin.save_checkpoint(ours, d, tok)
            theirs = hf_adapter.build(ModelConfig(name="hf", checkpoint=d))
        vocab = min(len(tok), 250)
        prompts = [[rng.randrange(10, vocab) for _ in range(rng.randint(8, 64))] for _ in range(args.requests)]
        steps = {"random": random_rows(rng, vocab)}
        joins = {"plugin": False, "hf": False}
        label = f"{args.model} tiny"
    else:
        import sys

        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from serving_smollm2 import chat_tasks

        from primerl.trainer.packing import pack

        cfg = ModelConfig(name=args.model, checkpoint=args.checkpoint)
        ours = plugin.build(cfg)
        tok = plugin.tokenizer(cfg)
        theirs = hf_adapter.build(ModelConfig(name="hf", checkpoint=args.checkpoint))
        tasks = chat_tasks(args.seed)
        prompts = [chat_ids(tok, next(tasks), True) for _ in range(args.requests)]
        steps = {env: pack(rl_samples(tok, env, args.seed), args.seq_len, share_prompts=True)
                 for env in ("reverse-text", "alphabet-sort")}
        joins = {"plugin": plugin.capabilities(cfg).varlen_rows, "hf": False}
        label = f"{args.model} {args.checkpoint} float32"
    models = {"plugin": ours, "hf": theirs}
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

    def run_train(name: str, step) -> float:
        m = models[name]
        m.train()
        t0 = time.perf_counter()
        with torch.enable_grad():
            if isinstance(step, dict):  # the tiny preset's rows, logits everywhere
                m(step["input_ids"], step["positions"], step["lengths"],
                  segment_ids=step["segment_ids"]).logits.logsumexp(-1).mean().backward()
            else:  # the trainer's forwards over a packed step (rl_step's, the loss a policy gradient)
                from primerl_single.strategy import Single

                from primerl.trainer.step import micro_batches, row_forward

                for row in micro_batches(step, Single(), 32, join=joins[name]):
                    mask = row["loss_mask"] & (row["sample_index"] >= 0)
                    lp, _ = row_forward(m, row, False, only=mask)
                    (-(lp * row["advantages"])[mask].sum() / step.num_loss_tokens).backward()
        m.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    engine_t: dict[str, list[float]] = {n: [] for n in models}
    train_t: dict[str, dict[str, list[float]]] = {s: {n: [] for n in models} for s in steps}
    for name in models:
        for step in steps.values():
            run_train(name, step)  # warm-up
    for r in range(args.rounds):
        order = list(models) if r % 2 == 0 else list(models)[::-1]
        for name in order:
            with torch.no_grad():
                models[name].eval()
                engine_t[name].append(run_engine(engines[name]))
            for s, step in steps.items():
                train_t[s][name].append(run_train(name, step))
        print(f"round {r + 1}: " + ", ".join(
            f"{n} engine {engine_t[n][-1]:.2f}s train " + "/".join(f"{train_t[s][n][-1]:.2f}" for s in steps) + "s"
            for n in models), flush=True)
    eng = {n: statistics.median(v) for n, v in engine_t.items()}
    train = {s: {n: statistics.median(v) for n, v in d.items()} for s, d in train_t.items()}
    for name in models:
        print(f"{name}: engine {useful / eng[name]:.0f} tok/s (rounds {[round(t, 2) for t in engine_t[name]]} s), "
              + ", ".join(f"train {s} {train[s][name] * 1e3:.0f} ms (rounds {[round(t * 1e3) for t in train_t[s][name]]})"
                          for s in steps))
    result = {
        "bench": "hf_model", "model": label, "requests": args.requests, "useful_tokens": useful,
        "engine_tokens_per_s": {n: round(useful / eng[n], 1) for n in models},
        "engine_ratio": round(eng["plugin"] / eng["hf"], 2),  # hf throughput / plugin's
    }
    if args.checkpoint is None:
        s = next(iter(steps))
        result |= {"train_step_ms": {n: round(train[s][n] * 1e3, 1) for n in models},
                   "train_ratio": round(train[s]["hf"] / train[s]["plugin"], 2)}  # hf step time / plugin's
    else:
        result |= {
            "train_rows": {s: {"rows": step.num_rows, "width": int(step.input_ids.shape[1]),
                               "tokens": int(step.lengths.sum()), "joined": joins["plugin"]} for s, step in steps.items()},
            "train_step_ms": {s: {n: round(train[s][n] * 1e3, 1) for n in models} for s in steps},
            "train_ratio": {s: round(train[s]["hf"] / train[s]["plugin"], 2) for s in steps},  # hf time / plugin's
            "plugin_speedup": {"engine": round(eng["hf"] / eng["plugin"], 2),
                               **{f"train_{s}": round(train[s]["hf"] / train[s]["plugin"], 2) for s in steps}},
            "load_avg_1m": round(os.getloadavg()[0], 1),
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
