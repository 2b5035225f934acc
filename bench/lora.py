"""Trainer memory and step time with and without LoRA, on the same model.

The qwen3 plugin's ``0.6b`` preset's shape cut to 4 layers (hidden 1024, vocab 151k: the
head and embeddings are most of it, as in small real models), float32 on the CPU: one
optimizer step (forward + backward over 2 packed rows of 512 tokens, AdamW) with every
weight training, and with ``[trainer.lora] rank = 16`` on every linear. Memory is counted
from the tensors themselves (parameters, gradients, AdamW's two moments), so it does not
depend on the allocator; step time is the median of the rounds, alternating the two.

    python bench/lora.py          # final line: {"memory_ratio": lora / full, "step_ratio": ...}
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    from primerl import lora
    from primerl.registry import get_registry
    from primerl.trainer.optim import make_optimizer

    adapter = get_registry().load("model", "qwen3")()
    hf = {**adapter.hf_config("0.6b"), "num_hidden_layers": args.layers}
    models = {"full": adapter.build_from_hf(hf, seed=0), "lora": adapter.build_from_hf(hf, seed=0)}
    lora.apply_lora(models["lora"], args.rank, 2.0 * args.rank)
    optimizers = {k: make_optimizer(m, 1e-4, 0.0) for k, m in models.items()}
    g = torch.Generator().manual_seed(0)
    S = 512
    ids = torch.randint(0, hf["vocab_size"], (2, S), generator=g)
    pos = torch.arange(S).expand(2, S)
    seg = (torch.arange(S) >= S // 2).long().expand(2, S)  # two sequences per row
    lengths = torch.full((2,), S)

    def step(name: str) -> float:
        m, opt = models[name], optimizers[name]
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        m(ids, pos, lengths, segment_ids=seg).logits.logsumexp(-1).mean().backward()
        opt.step()
        return time.perf_counter() - t0

    for name in models:
        step(name)  # warm-up, and AdamW's state exists from here

    def state_bytes(name: str) -> dict[str, int]:
        m, opt = models[name], optimizers[name]
        params = sum(p.numel() * p.element_size() for p in m.parameters())
        grads = sum(p.numel() * p.element_size() for p in m.parameters() if p.requires_grad)
        moments = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                      if torch.is_tensor(t) and t.dim() > 0)
        return {"parameters": params, "gradients": grads, "optimizer": moments, "total": params + grads + moments}

    times: dict[str, list[float]] = {n: [] for n in models}
    for _ in range(args.rounds):
        for name in models:
            times[name].append(step(name))
    mem = {n: state_bytes(n) for n in models}
    med = {n: statistics.median(t) for n, t in times.items()}
    trainable = {n: sum(p.numel() for p in m.parameters() if p.requires_grad) for n, m in models.items()}
    for n in models:
        print(f"{n}: {trainable[n] / 1e6:.2f}M trainable, parameters {mem[n]['parameters'] / 2**20:.0f} MiB, "
              f"gradients {mem[n]['gradients'] / 2**20:.0f} MiB, AdamW {mem[n]['optimizer'] / 2**20:.0f} MiB; "
              f"step {med[n]:.2f}s (rounds {[round(t, 2) for t in times[n]]})")
    print(json.dumps({
        "bench": "lora", "rank": args.rank, "layers": args.layers,
        "trainable_params": trainable,
        "train_state_mib": {n: round(mem[n]["total"] / 2**20, 1) for n in models},
        "step_s": {n: round(med[n], 3) for n in models},
        "memory_ratio": round(mem["lora"]["total"] / mem["full"]["total"], 3),
        "step_ratio": round(med["lora"] / med["full"], 3),
    }))


if __name__ == "__main__":
    main()
