"""Router replay (R3): the training/inference mismatch without vs with replay, per architecture,
measured as the papers measure it.

What and why. Inference runs in low precision (bf16 here, as vLLM serves), the trainer in
float32. In an MoE model a tiny numeric difference can flip a router's top-k choice, and
a flipped expert changes the token's distribution far more than rounding does. R3
records the experts inference used and makes the trainer use the same ones, so only
rounding remains. The published reductions (the R3 paper on Qwen3-30B-A3B: mismatch KL
1.5e-3 -> 7.5e-4; prime-rl: 3-7x on the same model) are reported as these figures, which
this bench reports too, per model, without and with replay:

* ``kl``: mean k3 mismatch KL, k3 = r - 1 - log r with r = p_train / p_inference of each
  sampled token (the trainer's ``mismatch_kl``);
* ``gt_ln2``: the share of sampled tokens with |log r| > ln 2 (probability off by more
  than 2x either way);
* ``max_abs_log_ratio``: the largest |log r|;
* ``flip_share``: the share of sampled tokens whose logits come from a position where the
  trainer's own top-k differs from inference's (as sets) in any MoE layer (without replay;
  with replay the trainer uses inference's experts, so it is 0 by construction);

with 95% confidence intervals from a bootstrap over prompts (a prompt's completions are
resampled together, as they are correlated), so a reader sees what is noise. At tiny
scale bf16 rounding, not routing flips, dominates the mismatch, and ~1,000 tokens gave
KL ratios of 0.73-1.47 between runs: hence >= 10,000 sampled tokens per model by default.

Method, for each of glm5, kimi, nemotron, qwen3-moe (tiny presets, same code paths as the
full models):

1. train the model for a while on a task (SFT on reverse-text answers), so that its
   routers are as decisive as trained routers are, not random;
2. copy it to bfloat16 and serve it with the embedded engine (routers kept in float32
   where HF keeps them: GLM-5, Kimi, Nemotron; Qwen3-MoE routes in the model dtype);
3. sample completions (temperature 1) for held-out prompts, recording the engine's
   logprobs and routed experts of every token;
4. recompute every sampled token's logprob with the float32 trainer model: once routing
   on its own (no R3), once replaying the engine's experts (R3).

``--large`` gives every model a real routing shape (top-8 of 256 experts in 24 MoE layers;
``--experts/--top-k/--moe-layers/--expert-width`` set it freely), for a GPU
(``--device cuda``; ``auto`` picks it when torch sees one).

    python bench/router_replay.py     # final line: {"bench": "router_replay", "models": {"glm5": {...}, ...}, ...}
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import math
import time

import numpy as np
import torch

ARCHS = ("glm5", "kimi", "nemotron", "qwen3-moe")
LN2 = math.log(2.0)
LARGE = {"experts": 256, "top_k": 8, "moe_layers": 24}  # --large: Qwen3-30B-A3B-like routing, GLM-5's expert count

NEMOTRON_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"  # Nemotron 3 Nano's 52 layers (23 MoE)
KINDS = {"M": "linear_attention", "E": "moe", "*": "full_attention"}


# ---------------------------------------------------------------------------------------
# Metrics (pure functions of logprobs and routings; tests/test_router_replay_metrics.py)
# ---------------------------------------------------------------------------------------


def k3(train_lp: torch.Tensor, infer_lp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 = r - 1 - log r, r = p_train / p_infer (float64; >= 0, 0 iff equal)."""
    return k3_of(train_lp.double() - infer_lp.double())


def k3_of(log_r: torch.Tensor) -> torch.Tensor:
    """k3 from log r = log p_train - log p_infer (float64)."""
    log_r = log_r.double()
    return torch.expm1(log_r) - log_r


def flipped(own: torch.Tensor, inference: torch.Tensor) -> torch.Tensor:
    """own, inference: [T, L, k] expert ids -> [T] bool: the trainer's top-k differs from
    inference's, as sets, in at least one of the L MoE layers."""
    same = own.long().sort(-1).values == inference.long().sort(-1).values  # [T, L, k]
    return ~same.all(-1).all(-1)


def metrics(log_r: torch.Tensor) -> dict[str, float]:
    """The figures of one side from per-token log r = log p_train - log p_infer."""
    log_r = log_r.double()
    return {"kl": float(k3_of(log_r).mean()),
            "gt_ln2": float((log_r.abs() > LN2).double().mean()),
            "max_abs_log_ratio": float(log_r.abs().max())}


def bootstrap(groups: np.ndarray, columns: dict[str, np.ndarray], ratios: dict[str, tuple[str, str]],
              reps: int = 2000, seed: int = 0, level: float = 0.95) -> dict[str, tuple[float, float]]:
    """Percentile intervals of per-token means, resampling whole groups (prompts).

    groups: [T] group id of each token; columns: name -> [T] per-token values, whose mean is
    the statistic; ratios: name -> (numerator column, denominator column), a ratio of two
    means taken on the same resample. Returns name -> (low, high)."""
    _, g = np.unique(groups, return_inverse=True)
    G = int(g.max()) + 1
    names = list(columns)
    sums = np.zeros((G, len(names) + 1))
    np.add.at(sums[:, 0], g, 1.0)
    for j, name in enumerate(names, 1):
        np.add.at(sums[:, j], g, np.asarray(columns[name], dtype=np.float64))
    draws = np.random.default_rng(seed).multinomial(G, np.full(G, 1.0 / G), size=reps)  # [reps, G]
    totals = draws @ sums  # [reps, 1 + columns]
    means = {name: totals[:, j] / totals[:, 0] for j, name in enumerate(names, 1)}
    stats = dict(means)
    for name, (num, den) in ratios.items():
        stats[name] = means[num] / np.maximum(means[den], 1e-300)
    q = [100 * (1 - level) / 2, 100 * (1 + level) / 2]
    return {name: tuple(float(v) for v in np.percentile(s, q)) for name, s in stats.items()}


def summarize(groups, log_r_no: torch.Tensor, log_r_r3: torch.Tensor, flip: torch.Tensor,
              reps: int = 2000, seed: int = 0) -> dict:
    """Per-model figures with bootstrap intervals. log_r_*: [T] per sampled token; flip: [T]
    bool (trainer's own routing differs from inference's); groups: [T] prompt ids."""
    no, r3 = metrics(log_r_no), metrics(log_r_r3)
    cols = {"kl_no_r3": k3_of(log_r_no).numpy(), "kl_r3": k3_of(log_r_r3).numpy(),
            "gt_ln2_no_r3": (log_r_no.abs() > LN2).double().numpy(),
            "gt_ln2_r3": (log_r_r3.abs() > LN2).double().numpy(), "flip_share": flip.double().numpy()}
    ci = bootstrap(np.asarray(groups), cols, {"kl_reduction": ("kl_no_r3", "kl_r3")}, reps=reps, seed=seed)
    f = flip.bool()
    out = {"tokens": int(flip.numel()), "prompts": int(len(np.unique(np.asarray(groups))))}
    out.update(kl_no_r3=no["kl"], kl_r3=r3["kl"], kl_reduction=no["kl"] / max(r3["kl"], 1e-300),
               gt_ln2_no_r3=no["gt_ln2"], gt_ln2_r3=r3["gt_ln2"],
               max_abs_log_ratio_no_r3=no["max_abs_log_ratio"], max_abs_log_ratio_r3=r3["max_abs_log_ratio"],
               flip_share=float(f.double().mean()))
    for name, (lo, hi) in ci.items():
        out[f"{name}_ci"] = [lo, hi]
    # where the flips are: KL of flipped tokens without / with replay, the share of the
    # no-replay KL they carry, and the KL of the rest
    if f.any():
        out["kl_no_r3_flipped"] = float(k3_of(log_r_no[f]).mean())
        out["kl_r3_flipped"] = float(k3_of(log_r_r3[f]).mean())
        out["flipped_kl_share"] = float(k3_of(log_r_no[f]).sum() / max(float(k3_of(log_r_no).sum()), 1e-300))
    if (~f).any():
        out["kl_no_r3_unflipped"] = float(k3_of(log_r_no[~f]).mean())
    return out


def sig(x, digits: int = 4):
    """Round floats (also inside lists and dicts) to ``digits`` significant digits for printing."""
    if isinstance(x, float):
        return float(f"{x:.{digits}g}")
    if isinstance(x, list):
        return [sig(v, digits) for v in x]
    if isinstance(x, dict):
        return {k: sig(v, digits) for k, v in x.items()}
    return x


# ---------------------------------------------------------------------------------------
# Models, sampling, scoring
# ---------------------------------------------------------------------------------------


def routing_shape(name: str, hf: dict, experts: int, top_k: int, moe_layers: int, width: int) -> dict:
    """The tiny preset with the real models' routing shape: top-``top_k`` of ``experts``
    experts in ``moe_layers`` MoE layers (expert width ``width``); everything else tiny.
    Nemotron keeps Nano's Mamba/attention/MoE pattern, repeated past its 23 MoE layers."""
    hf = dict(hf, num_experts_per_tok=top_k, moe_intermediate_size=width)
    if name == "qwen3-moe":
        hf.update(num_experts=experts, num_hidden_layers=moe_layers + 1, mlp_only_layers=[0])
    else:
        hf["n_routed_experts"] = experts
    if name == "glm5":
        n = moe_layers + 1
        hf.update(num_hidden_layers=n, first_k_dense_replace=1, mlp_layer_types=["dense"] + ["sparse"] * moe_layers,
                  indexer_types=["full" if i % 2 == 0 else "shared" for i in range(n)])
    elif name == "kimi":
        hf.update(num_hidden_layers=moe_layers + 1, first_k_dense_replace=1)
    elif name == "nemotron":
        codes, seen = [], 0
        for c in itertools.cycle(NEMOTRON_PATTERN):
            codes.append(c)
            seen += c == "E"
            if seen == moe_layers:
                break
        hf["layers_block_type"] = [KINDS[c] for c in codes]
        hf["moe_shared_expert_intermediate_size"] = 2 * width
    return hf


def train(name: str, args) -> tuple:
    """A tiny ``name`` model (with the chosen routing shape), SFT-trained on reverse-text answers."""
    from primerl.config import RunConfig
    from primerl.registry import get_registry
    from primerl.trainer.main import load_parallelism
    from primerl.trainer.sft import sft_warmup

    cfg = RunConfig()
    cfg.model.name, cfg.model.seed = name, args.seed
    cfg.env = get_registry().load("env", "reverse-text").Config(name="reverse-text", max_words=2,
                                                                 num_eval=max(200, args.prompts))
    cfg.sft.steps, cfg.sft.lr, cfg.sft.batch_size = args.sft_steps, args.lr, 16
    cfg.trainer.seq_len = 512
    cfg.trainer.device = args.device
    cfg.trainer.router_bias_update_rate = args.balance  # trained routers are load-balanced
    torch.manual_seed(args.seed)
    adapter = get_registry().load("model", name)()
    hf = adapter.hf_config("tiny")
    if args.experts:
        hf = routing_shape(name, hf, args.experts, args.top_k, args.moe_layers, args.expert_width)
    model = adapter.build_from_hf(hf, seed=args.seed).to(args.device).train()
    tokenizer = adapter.tokenizer(cfg.model)
    sft_warmup(cfg, model, tokenizer, load_parallelism("single"))
    env = get_registry().load("env", "reverse-text")(cfg.env)
    return model.eval(), tokenizer, env


def rollouts(model, tokenizer, env, args) -> tuple[list, list[int]]:
    """Samples ``args.n`` completions of each of ``args.prompts`` eval prompts from a bfloat16
    copy of ``model`` (weights FP8-rounded with ``--weights fp8``) served by the embedded
    engine. Returns the sequences and each one's prompt index."""
    from primerl_embedded.engine import Engine, SamplingParams

    from primerl.envs.multiturn import prompt_ids
    from primerl.models.fp8 import fp8_round_trip_

    served = copy.deepcopy(model).cast_(torch.bfloat16).eval()
    if args.weights == "fp8":
        fp8_round_trip_(served)
    batch = min(args.engine_batch, args.prompts * args.n)
    engine = Engine(served, eos_token_ids=[tokenizer.eos_token_id], max_batch_size=batch, max_model_len=256,
                    kv_slots=2 * batch, num_experts=max(256, args.experts))
    tasks = [t for _, t in zip(range(args.prompts), env.tasks("eval"))]
    seqs, groups = [], []
    for i, task in enumerate(tasks):
        ids = prompt_ids(tokenizer, task.messages(env.system_prompt))
        params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=args.seed + i, n=args.n,
                                logprobs=0, return_routed_experts=True)
        new = engine.submit(ids, params)
        seqs += new
        groups += [i] * len(new)
    while engine.has_work():
        engine.step()
    return seqs, groups


@torch.no_grad()
def score(model, seqs, groups, batch: int = 64) -> dict[str, torch.Tensor]:
    """The float32 trainer's view of every sampled token, without and with replay.

    Sequences are scored ``batch`` at a time as right-padded rows. Returns per sampled token
    (concatenated over sequences): ``log_r_no``/``log_r_r3`` (log p_train - log p_infer),
    ``flip`` (the trainer's own top-k differs from the engine's in some MoE layer at the
    position that predicts the token), ``group`` (prompt index); and ``agree``: the share
    of (position, MoE layer) pairs routed identically, over every recorded position."""
    from primerl.sampling import token_logprobs

    device = next(model.parameters()).device
    out = {"log_r_no": [], "log_r_r3": [], "flip": [], "group": []}
    agree = pairs = 0
    for start in range(0, len(seqs), batch):
        chunk = seqs[start : start + batch]
        recs = [s.routed_experts().long() for s in chunk]  # [n - 1, L, k]: the last token was never fed back
        lens = [len(s.tokens) for s in chunk]
        B, S = len(chunk), max(lens)
        ids = torch.zeros(B, S, dtype=torch.long)
        replay = torch.zeros(B, S, *recs[0].shape[1:], dtype=torch.long)
        for b, (s, rec, n) in enumerate(zip(chunk, recs, lens)):
            assert rec.shape[0] == n - 1, (rec.shape, n)
            ids[b, :n] = torch.tensor(s.tokens)
            replay[b, : n - 1], replay[b, n - 1] = rec, rec[-1]
        ids, pos = ids.to(device), torch.arange(S, device=device).expand(B, S)
        lengths = torch.tensor(lens, device=device)
        lps = {}
        for key, rep in (("no", None), ("r3", replay.to(device))):
            o = model(ids, pos, lengths, replay_experts=rep)
            lps[key] = token_logprobs(o.logits[:, :-1].float(), ids[:, 1:], 1.0).double().cpu()  # [B, S - 1]
            if rep is None:
                own = o.router_experts.cpu()
        for b, (s, rec, n) in enumerate(zip(chunk, recs, lens)):
            p = len(s.prompt_ids)
            engine_lp = torch.tensor(s.logprobs, dtype=torch.float64)
            assert engine_lp.numel() == n - p
            out["log_r_no"].append(lps["no"][b, p - 1 : n - 1] - engine_lp)
            out["log_r_r3"].append(lps["r3"][b, p - 1 : n - 1] - engine_lp)
            out["flip"].append(flipped(own[b, p - 1 : n - 1], rec[p - 1 :]))
            out["group"].append(torch.full((n - p,), groups[start + b]))
            same = (own[b, : n - 1].long().sort(-1).values == rec.sort(-1).values).all(-1)  # [n - 1, L]
            agree += int(same.sum())
            pairs += same.numel()
    res = {k: torch.cat(v) for k, v in out.items()}
    res["agree"] = agree / max(pairs, 1)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archs", default=",".join(ARCHS))
    ap.add_argument("--sft-steps", type=int, default=200)
    ap.add_argument("--balance", type=float, default=1e-3, help="router bias update rate while training")
    ap.add_argument("--weights", choices=("bf16", "fp8"), default="bf16", help="inference weights")
    ap.add_argument("--large", action="store_true",
                    help="real routing shape: --experts 256 --top-k 8 --moe-layers 24 (for a GPU)")
    ap.add_argument("--experts", type=int, default=0,
                    help="0: the tiny presets as shipped; else this many experts (with the options below)")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--moe-layers", type=int, default=8)
    ap.add_argument("--expert-width", type=int, default=32)
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--prompts", type=int, default=200, help="held-out prompts (bootstrap unit)")
    ap.add_argument("--n", type=int, default=8, help="completions per prompt")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--engine-batch", type=int, default=128, help="engine max batch size")
    ap.add_argument("--score-batch", type=int, default=64, help="sequences per trainer forward")
    ap.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples")
    ap.add_argument("--device", default="auto", help="auto (cuda when torch sees a GPU), cpu or cuda")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.large:  # the real shape, where not set explicitly
        for key, value in LARGE.items():
            if getattr(args, key) == ap.get_default(key):
                setattr(args, key, value)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    from primerl.models import experts

    # Every expert on every token (one matmul) instead of a loop over experts: at these
    # widths it is many times faster on a CPU, and engine and trainer both use it.
    experts.DENSE_EXPERTS_MAX_RATIO = max(experts.DENSE_EXPERTS_MAX_RATIO, args.experts // args.top_k)
    routing = (f"top-{args.top_k} of {args.experts} experts, {args.moe_layers} MoE layers" if args.experts
               else "tiny presets")
    print(f"[router_replay] {routing}, {args.sft_steps} SFT steps, {args.prompts} prompts x {args.n} completions, "
          f"{args.weights} engine vs fp32 trainer on {args.device}", flush=True)

    models = {}
    for name in args.archs.split(","):
        t0, c0 = time.perf_counter(), time.process_time()
        print(f"[router_replay] {name}: training", flush=True)
        model, tokenizer, env = train(name, args)
        t1 = time.perf_counter()
        print(f"[router_replay] {name}: sampling ({t1 - t0:.0f}s so far)", flush=True)
        seqs, groups = rollouts(model, tokenizer, env, args)
        t2 = time.perf_counter()
        print(f"[router_replay] {name}: scoring {len(seqs)} completions ({t2 - t0:.0f}s so far)", flush=True)
        s = score(model, seqs, groups, args.score_batch)
        t3 = time.perf_counter()
        r = summarize(s["group"].numpy(), s["log_r_no"], s["log_r_r3"], s["flip"], reps=args.bootstrap, seed=args.seed)
        r.update(routing_agreement=s["agree"], train_s=round(t1 - t0, 1), sample_s=round(t2 - t1, 1),
                 score_s=round(t3 - t2, 1), cpu_s=round(time.process_time() - c0, 1))
        models[name] = sig(r)
        print(json.dumps({"model": name, **models[name]}), flush=True)
    print(json.dumps({"bench": "router_replay", "inference_dtype": "bfloat16", "trainer_dtype": "float32",
                      "device": args.device, "sft_steps": args.sft_steps, "routing": routing,
                      "weights": args.weights, "ci": "95% bootstrap over prompts",
                      "kl_reduction": {k: v["kl_reduction"] for k, v in models.items()}, "models": models}))


if __name__ == "__main__":
    main()
