"""The engine's decode step and the trainer's RL step each as one compiled graph vs eager.

Why: ``bench/vs_trl.py`` is bound by the CPU seconds of two serial loops, the engine's
decode forwards and the trainer's steps (docs/benchmarks.md, "Where the time goes"), and
both are hundreds of small ops on the tiny GLM-5 preset (hidden 128). The lever left
after the per-layer ``torch.compile`` attempts was the whole step as one graph: inductor
fusing the elementwise chains, a C++ wrapper (``cpp_wrapper``) instead of Python between
the kernels, static shapes (no recompiles). This measures that lever on this machine,
one torch thread (what each role gets in ``primerl run`` on 2 cores):

* decode: 64 rows, one new token each after 30-43 cached ones (a vs-TRL batch mid-way),
  the cache read in place; ``engine`` is the model's forward exactly as
  ``Engine._forward`` calls it; ``eager`` and ``compiled`` are the same forward made
  traceable (below) over a static cache window of 64 positions, run eagerly and as one
  inductor graph (``fullgraph=True``);
* train: 12 rows of 128 tokens (the ~1,500 positions of a vs-TRL step), forward, a
  policy-gradient loss, backward and fused AdamW; ``trainer`` the model as the trainer
  runs it, ``eager`` / ``compiled`` the traceable forward.

What it takes to trace either forward as one graph (each keeps the maths, up to
rounding). The models do part of it themselves while ``torch.compile`` traces them: the
derived-weight caches are rebuilt in the graph (dynamo cannot read tensor versions),
RoPE always copies its pairs (no storage-offset check), the DSA indexer scores every
query (its shortcut for queries that keep all their keys depends on the data). This
bench adds, in its own process only: routed experts in their dense form (every expert
on every token; ``torch._grouped_mm`` has no float32 fake-tensor kernel on the CPU, and
the per-expert loop reads the counts as Python ints), the context-parallel
``ContextVar`` read skipped, and the decode batch's cache addressing built from static
shapes instead of ``nonzero`` and ``int(max(...))``.

    python bench/compiled_step.py     # final line: {"speedup": {"decode": ..., "train": ...}, ...}

``speedup`` is engine / compiled and trainer / compiled (medians): what the compiled
graph would save against the code that runs today. ``frozen`` bounds what compiling can
give the decode step: the same graph with the weights frozen in as constants (inductor's
``freezing`` and ``max_autotune``: prepacked oneDNN GEMMs). An engine cannot use it as
such, since its weights change every step and each change would compile anew.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

DECODE_ROWS, CACHE_WINDOW = 64, 64
TRAIN_ROWS, TRAIN_LEN = 12, 128


def timed(fn, calls: int) -> float:
    """Milliseconds per call of ``fn`` (mean of ``calls``)."""
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1000


def make_traceable() -> None:
    """The bench-only patches of the module docstring, for this process."""
    import primerl.models.batch as batch_mod
    import primerl.models.experts as experts

    experts.DENSE_GROUPED_MAX_TOKENS = experts.DENSE_EXPERTS_MAX_TOKENS = 1 << 30  # dense experts

    class NoShard:  # make_batch's context-parallel ContextVar: nothing sharded here
        def get(self):
            return None

    batch_mod._row_shard = NoShard()


def decode_step(model, cache, ids: torch.Tensor, past: torch.Tensor):
    """One decode forward over rows 0..B-1 of ``cache`` with a static key window: what the
    engine would run as a graph. ids: [B, 1]; past: [B] cached tokens per row."""
    from primerl.models.batch import Batch

    B = ids.shape[0]
    rows = torch.arange(B)
    visible = torch.arange(CACHE_WINDOW)[None, None, :] <= past[:, None, None]  # [B, 1, T]
    batch = Batch(past[:, None], torch.ones(B, dtype=torch.long), torch.ones(B, 1, dtype=torch.bool), visible,
                  None, cache, rows, past, (rows, torch.zeros(B, dtype=torch.long), rows, past), slot_range=(0, B))
    x = model.model.embed_tokens(ids)  # [B, 1, hidden]
    model.prepare(batch, x.dtype)
    valid, carry, used = batch.valid.flatten(), None, []
    for layer in model.model.layers:
        x, carry, routing = layer(x, batch, valid, carry, None)
        if routing is not None:
            used.append(routing.ids.view(B, 1, -1))
    return model.lm_head(model.model.norm(x[:, 0])), torch.stack(used, 2)  # [B, V], [B, 1, L, k]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    import torch._inductor.config as inductor

    from primerl.models import ModelConfig
    from primerl.registry import get_registry

    torch.set_num_threads(1)
    inductor.cpp_wrapper = True
    model = get_registry().load("model", "glm5")().build(ModelConfig(name="glm5", preset="tiny", seed=0))
    gen = torch.Generator().manual_seed(0)

    # ---- decode: the engine's call, before the forward is made traceable ----
    model.eval()
    cache = model.new_cache(128, 256)
    ids = torch.randint(10, 250, (DECODE_ROWS, 1), generator=gen)
    past = torch.randint(30, 44, (DECODE_ROWS,), generator=gen)
    with torch.no_grad():  # fill the rows' cached positions so attention reads real keys
        for t in cache.tensors():
            t.normal_(generator=gen)

    def engine_call():
        return model(ids, past[:, None].clone(), torch.ones(DECODE_ROWS, dtype=torch.long), cache=cache,
                     slots=range(DECODE_ROWS), past_lens=past, logits_for="last")

    with torch.inference_mode():
        engine_ref = engine_call().logits
        engine_ms = [timed(engine_call, 50) for _ in range(args.rounds)]

    # ---- train: the trainer's forward as it runs today ----
    model.train()
    tids = torch.randint(10, 250, (TRAIN_ROWS, TRAIN_LEN), generator=gen)
    tpos = torch.arange(TRAIN_LEN)[None].expand(TRAIN_ROWS, TRAIN_LEN)
    tlen = torch.full((TRAIN_ROWS,), TRAIN_LEN)
    adv = torch.randn(TRAIN_ROWS, TRAIN_LEN - 1, generator=gen)
    opt = torch.optim.AdamW(model.parameters(), lr=0.0, fused=True)  # lr 0: every step sees the same weights

    def loss(tids, tpos, tlen, adv):
        logits = model(tids, tpos, tlen).logits  # [B, S, V]
        logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, tids[:, 1:, None]).squeeze(-1)
        return -(logp * adv).mean()

    def train_step(fn):
        opt.zero_grad(set_to_none=True)
        fn(tids, tpos, tlen, adv).backward()
        opt.step()

    train_step(loss)
    trainer_ms = [timed(lambda: train_step(loss), 5) for _ in range(args.rounds)]

    # ---- the traceable forward, eager and compiled, alternating ----
    make_traceable()
    model.eval()
    with torch.no_grad():
        step = lambda: decode_step(model, cache, ids, past)
        eager_logits, eager_ids = step()
        t0 = time.perf_counter()
        compiled = torch.compile(decode_step, fullgraph=True, dynamic=False)
        comp_logits, comp_ids = compiled(model, cache, ids, past)
        decode_compile_s = time.perf_counter() - t0
        decode_eager, decode_comp = [], []
        for _ in range(args.rounds):
            decode_eager.append(timed(step, 50))
            decode_comp.append(timed(lambda: compiled(model, cache, ids, past), 50))
    model.train()
    t0 = time.perf_counter()
    compiled_loss = torch.compile(loss, fullgraph=True, dynamic=False)
    train_step(compiled_loss)
    train_compile_s = time.perf_counter() - t0
    train_eager, train_comp = [], []
    for _ in range(args.rounds):
        train_eager.append(timed(lambda: train_step(loss), 5))
        train_comp.append(timed(lambda: train_step(compiled_loss), 5))

    # ---- the bound: the decode graph with the weights frozen in (not usable by the engine) ----
    torch._dynamo.reset()
    model.eval()
    with torch.no_grad():
        t0 = time.perf_counter()
        frozen = torch.compile(decode_step, fullgraph=True, dynamic=False,
                               options={"freezing": True, "max_autotune": True})
        frozen_logits, _ = frozen(model, cache, ids, past)
        frozen_compile_s = time.perf_counter() - t0
        decode_frozen = [timed(lambda: frozen(model, cache, ids, past), 50) for _ in range(args.rounds)]

    med = lambda xs: round(statistics.median(xs), 2)
    decode = {"engine": med(engine_ms), "eager": med(decode_eager), "compiled": med(decode_comp),
              "frozen": med(decode_frozen)}
    train = {"trainer": med(trainer_ms), "eager": med(train_eager), "compiled": med(train_comp)}
    print(json.dumps({
        "bench": "compiled_step", "rounds": args.rounds, "threads": 1,
        "decode_ms": decode, "decode_compile_s": round(decode_compile_s, 1),
        "frozen_compile_s": round(frozen_compile_s, 1),
        "decode_max_abs_diff": {"compiled_vs_eager": float((comp_logits - eager_logits).abs().max()),
                                "frozen_vs_eager": float((frozen_logits - eager_logits).abs().max()),
                                "eager_vs_engine": float((eager_logits - engine_ref).abs().max())},
        "decode_same_experts": bool(torch.equal(comp_ids, eager_ids)),
        "train_ms": train, "train_compile_s": round(train_compile_s, 1),
        "speedup": {"decode": round(decode["engine"] / decode["compiled"], 2),
                    "decode_frozen": round(decode["engine"] / decode["frozen"], 2),
                    "train": round(train["trainer"] / train["compiled"], 2)},
    }))


if __name__ == "__main__":
    main()
