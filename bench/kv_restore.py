"""KV offload: restoring an evicted prefix from the ``disk`` or ``mooncake`` store vs recomputing it.

What a KV store that offloads buys: when an idle prefix has been evicted from the
engine's slots (other traffic needed them), the next prompt that starts with it either
recomputes it (a prefill) or reads its KV blocks back (files, or the Mooncake pool over
TCP) into a slot and runs only the rest. This measures both on the same engine, the same
long prefix, in alternating rounds:

* recompute round: a no-op weight update first (the policy version moves on, so every
  stored block misses and the idle slots are cleared), then the prompt is served cold;
* restore round: two unrelated short requests evict the prompt's prefix from the idle
  slots (the disk store writes it to files then; the Mooncake store wrote it to the pool
  when the cold request finished), then the same prompt is served from the blocks.

Each timed request is the prompt (``--prefix`` tokens, whole blocks, + 1 token) with one
generated token: the time to its first token, minus the time the engine spends handing
the finished sequence to the store (``keep``: the same work after either round, and not
part of serving the prompt). Medians over ``--rounds``; the figure is recompute / restore
(> 1: restoring is faster). Tiny GLM-5 preset, float32, CPU unless ``--device cuda``. The
Mooncake store gets a master of its own (``primerl_kv_mooncake.master``), on this machine.

    python bench/kv_restore.py      # final line: {"restore_vs_recompute": {"disk": x, "mooncake": y}, ...}

``bench/prefix_routing.py`` imports :func:`measure_restore_vs_recompute`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Iterator
from typing import Any

STORES = ("disk", "mooncake")


@contextlib.contextmanager
def _store(name: str, block_size: int) -> Iterator[Any]:
    """The store under test, with a Mooncake master of its own for ``mooncake``."""
    if name == "disk":
        from primerl_kv_disk.store import DiskStore

        store = DiskStore(block_size=block_size)
        try:
            yield store
        finally:
            store.files.close()
    elif name == "mooncake":
        from primerl_kv_mooncake.master import start_master
        from primerl_kv_mooncake.store import MooncakeStore

        with start_master() as master:
            store = MooncakeStore(master.address, master.metadata_url, block_size=block_size,
                                  segment_bytes=256 << 20, buffer_bytes=64 << 20)
            try:
                yield store
            finally:
                store.close()
    else:
        raise ValueError(f"unknown store {name!r}: one of {STORES}")


def measure(store: str, *, prefix: int = 1024, block_size: int = 64, rounds: int = 7, model: str = "glm5",
            device: str = "cpu", seed: int = 0) -> dict[str, float]:
    """Medians of one store's rounds (see the module docstring): ``recompute_ms``,
    ``restore_ms``, their ratio ``restore_vs_recompute``, ``keep_ms`` (what handing a cold
    finished sequence to the store costs: the disk store's write happens at eviction, the
    Mooncake store's put here) and the prefix's ``kv_bytes``."""
    import torch
    from primerl_embedded.engine import Engine, SamplingParams

    from primerl.models import ModelConfig
    from primerl.registry import get_registry

    if prefix % block_size:
        raise ValueError(f"prefix ({prefix}) must be whole blocks of {block_size}")
    torch.set_grad_enabled(False)
    torch.manual_seed(seed)
    adapter = get_registry().load("model", model)()
    cfg = ModelConfig(name=model, preset="tiny", seed=seed)
    net, tok = adapter.build(cfg, device=device), adapter.tokenizer(cfg)
    vocab = net.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, vocab, (prefix + 1,), generator=g).tolist()  # whole blocks + the token that runs
    fillers = [[1, 2, 3, 4], [2, 3, 4, 5]]  # no first token in common with the prompt (>= 3... see below)
    fillers = [[f[0] + (f[0] == prompt[0])] + f[1:] for f in fillers]
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, return_routed_experts=True)

    with _store(store, block_size) as kv:
        kept = [0.0]
        keep = kv.keep

        def timed_keep(slot, tokens, routed):
            t = time.perf_counter()
            keep(slot, tokens, routed)
            kept[0] += time.perf_counter() - t

        kv.keep = timed_keep  # the engine calls the instance's keep
        eng = Engine(net, kv_store=kv, eos_token_ids=[tok.eos_token_id], max_batch_size=1,
                     max_model_len=prefix + 64, kv_slots=2, num_experts=adapter.moe_layout(cfg).get("num_experts"))

        def serve() -> tuple[float, float, Any]:
            kept[0] = 0.0
            if device != "cpu":
                torch.cuda.synchronize()
            t = time.perf_counter()
            (seq,) = eng.generate(prompt, one)
            if device != "cpu":
                torch.cuda.synchronize()
            return time.perf_counter() - t - kept[0], kept[0], seq

        recompute, restore, keeps = [], [], []
        for r in range(rounds + 1):  # round 0 warms up
            eng.update_weights(lambda: None)  # new version: every block misses, idle slots cleared
            before = kv.stats.restored_tokens
            t_cold, t_keep, cold = serve()
            assert kv.stats.restored_tokens == before, "the cold request must not restore anything"
            for f in fillers:
                eng.generate(f, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
            assert kv.idle.lookup(prompt) is None, "the prompt's prefix must have left the idle slots"
            t_warm, _, warm = serve()
            assert kv.stats.restored_tokens - before == prefix, "the prompt must be restored from the blocks"
            assert warm.output_ids == cold.output_ids and torch.equal(warm.routed_experts(), cold.routed_experts())
            if r:
                recompute.append(t_cold)
                restore.append(t_warm)
                keeps.append(t_keep)
        kv_bytes = sum(t[0, 0].numel() * t.element_size() for t in eng.cache.tensors()) * prefix
    rc, rs = statistics.median(recompute), statistics.median(restore)
    return {"restore_vs_recompute": rc / rs, "recompute_ms": rc * 1e3, "restore_ms": rs * 1e3,
            "keep_ms": statistics.median(keeps) * 1e3, "kv_bytes": kv_bytes}


def measure_restore_vs_recompute(store: str) -> float:
    """Time to recompute an evicted prefix / time to restore it from ``store`` (``disk`` or
    ``mooncake``): same engine, same long prefix, alternating rounds, medians (> 1: restoring wins)."""
    return measure(store)["restore_vs_recompute"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stores", default=",".join(STORES))
    ap.add_argument("--prefix", type=int, default=1024, help="prefix tokens (whole blocks)")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    ratios, details = {}, {}
    for name in args.stores.split(","):
        m = measure(name, prefix=args.prefix, block_size=args.block_size, rounds=args.rounds, device=args.device)
        details[name] = {k: round(v, 3) for k, v in m.items()}
        ratios[name] = round(m["restore_vs_recompute"], 2)
        print(f"{name}: recompute {m['recompute_ms']:.1f} ms, restore {m['restore_ms']:.1f} ms "
              f"({m['kv_bytes'] / 2**20:.2f} MiB of KV), x{m['restore_vs_recompute']:.1f}; "
              f"handing a finished sequence to the store: {m['keep_ms']:.2f} ms", flush=True)
    print(json.dumps({"restore_vs_recompute": ratios, "details": details}))


if __name__ == "__main__":
    main()
