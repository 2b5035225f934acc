"""Router replay (R3): training/inference mismatch KL without vs with replay, per architecture.

The mismatch RL suffers from in production: inference runs in low precision (bf16 here,
as vLLM serves), the trainer in float32. In an MoE model a tiny numeric difference can
flip a router's top-k choice, and a flipped expert changes the token's distribution far
more than rounding does. R3 records the experts inference used and makes the trainer use
the same ones, so only rounding remains.

Method, for each of glm5, kimi, nemotron, qwen3-moe (tiny presets, same code paths as the
full models):

1. train the model for a while on a task (SFT on reverse-text answers), so that its
   routers are as decisive as trained routers are, not random;
2. copy it to bfloat16 and serve it with the embedded engine (routers kept in float32
   where HF keeps them: GLM-5, Kimi, Nemotron; Qwen3-MoE routes in the model dtype);
3. sample completions (temperature 1) for held-out prompts, recording the engine's
   logprobs and routed experts of every token;
4. recompute every sampled token's logprob with the float32 trainer model: once routing
   on its own (no R3), once replaying the engine's experts (R3);
5. mismatch KL = mean over sampled tokens of k3 = r - log r - 1, r = p_train / p_infer
   (the trainer's ``mismatch_kl``); routing agreement = share of (token, MoE layer) whose
   trainer top-k equals the engine's.

    python bench/router_replay.py     # final line: {"kl_reduction": {"glm5": x, ...}, ...}
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch

ARCHS = ("glm5", "kimi", "nemotron", "qwen3-moe")


NEMOTRON_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"  # Nemotron 3 Nano's 52 layers
KINDS = {"M": "linear_attention", "E": "moe", "*": "full_attention"}


def routing_shape(name: str, hf: dict, experts: int, top_k: int, moe_layers: int, width: int) -> dict:
    """The tiny preset with the real models' routing shape: top-``top_k`` of ``experts``
    experts in ``moe_layers`` MoE layers (expert width ``width``); everything else tiny."""
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
        codes = NEMOTRON_PATTERN[: next(i + 1 for i in range(len(NEMOTRON_PATTERN))
                                        if NEMOTRON_PATTERN[: i + 1].count("E") == moe_layers)]
        hf["layers_block_type"] = [KINDS[c] for c in codes]
        hf["moe_shared_expert_intermediate_size"] = 2 * width
    return hf


def train(name: str, args) -> tuple:
    """A tiny ``name`` model with the real routing shape, SFT-trained on reverse-text answers."""
    from primerl.config import RunConfig
    from primerl.registry import get_registry
    from primerl.trainer.main import load_parallelism
    from primerl.trainer.sft import sft_warmup

    cfg = RunConfig()
    cfg.model.name, cfg.model.seed = name, args.seed
    cfg.env = get_registry().load("env", "reverse-text").Config(name="reverse-text", max_words=2)
    cfg.sft.steps, cfg.sft.lr, cfg.sft.batch_size = args.sft_steps, args.lr, 16
    cfg.trainer.seq_len = 512
    cfg.trainer.router_bias_update_rate = args.balance  # trained routers are load-balanced
    torch.manual_seed(args.seed)
    adapter = get_registry().load("model", name)()
    hf = adapter.hf_config("tiny")
    if args.experts:
        hf = routing_shape(name, hf, args.experts, args.top_k, args.moe_layers, args.expert_width)
    model = adapter.build_from_hf(hf, seed=args.seed).train()
    tokenizer = adapter.tokenizer(cfg.model)
    sft_warmup(cfg, model, tokenizer, load_parallelism("single"))
    env = get_registry().load("env", "reverse-text")(cfg.env)
    return model.eval(), tokenizer, env


def rollouts(model, tokenizer, env, prompts: int, n: int, max_tokens: int, seed: int, weights: str = "bf16"):
    """Samples from a bfloat16 copy of ``model`` (weights FP8-rounded when ``weights`` is
    "fp8") served by the embedded engine."""
    from primerl_embedded.engine import Engine, SamplingParams

    from primerl.envs.multiturn import prompt_ids
    from primerl.models.fp8 import fp8_round_trip_

    served = copy.deepcopy(model).cast_(torch.bfloat16).eval()
    if weights == "fp8":
        fp8_round_trip_(served)
    engine = Engine(served, eos_token_ids=[tokenizer.eos_token_id], max_batch_size=min(64, prompts * n), max_model_len=256,
                    kv_slots=prompts * n + 8, num_experts=256)
    tasks = [t for _, t in zip(range(prompts), env.tasks("eval"))]
    seqs = []
    for i, task in enumerate(tasks):
        ids = prompt_ids(tokenizer, task.messages(env.system_prompt))
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed + i, n=n, logprobs=0,
                                return_routed_experts=True)
        seqs += engine.submit(ids, params)
    while engine.has_work():
        engine.step()
    return seqs


@torch.no_grad()
def mismatch(model, seqs) -> dict[str, float]:
    """Mismatch KL of the float32 trainer against the engine, without and with replay."""
    from primerl.sampling import token_logprobs

    sums = {"kl_no_r3": 0.0, "kl_r3": 0.0, "agree": 0.0}
    tokens = routed = 0
    for seq in seqs:
        full = torch.tensor([seq.tokens])
        n, p = full.shape[1], len(seq.prompt_ids)
        recorded = seq.routed_experts().long()  # [n - 1, L, k]: the last token was never fed back
        replay = torch.cat([recorded, recorded[-1:]])[None]  # [1, n, L, k]
        engine_lp = torch.tensor(seq.logprobs, dtype=torch.float64)
        for key, rep in (("kl_no_r3", None), ("kl_r3", replay)):
            out = model(full, torch.arange(n)[None], torch.tensor([n]), replay_experts=rep)
            lp = token_logprobs(out.logits[:, p - 1 : n - 1], full[:, p:], 1.0)[0].double()
            log_r = lp - engine_lp
            sums[key] += float((log_r.exp() - log_r - 1).sum())
            if rep is None:
                own = out.router_experts[0, : n - 1].sort(-1).values
                same = (own == recorded.to(own.dtype).sort(-1).values).all(-1)  # [n - 1, L]
                sums["agree"] += float(same.float().sum())
                routed += same.numel()
        tokens += n - p
    return {"kl_no_r3": sums["kl_no_r3"] / tokens, "kl_r3": sums["kl_r3"] / tokens,
            "routing_agreement": sums["agree"] / max(routed, 1), "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archs", default=",".join(ARCHS))
    ap.add_argument("--sft-steps", type=int, default=200)
    ap.add_argument("--balance", type=float, default=1e-3, help="router bias update rate while training")
    ap.add_argument("--weights", choices=("bf16", "fp8"), default="bf16", help="inference weights")
    ap.add_argument("--experts", type=int, default=0,
                    help="0: the tiny presets as shipped; else this many experts (with the options below)")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--moe-layers", type=int, default=8)
    ap.add_argument("--expert-width", type=int, default=32)
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from primerl.models import layers

    # Every expert on every token (one matmul) instead of a loop over experts: at these
    # widths it is many times faster on a CPU, and engine and trainer both use it.
    layers.DENSE_EXPERTS_MAX_RATIO = max(layers.DENSE_EXPERTS_MAX_RATIO, args.experts // args.top_k)
    routing = (f"top-{args.top_k} of {args.experts} experts, {args.moe_layers} MoE layers" if args.experts
               else "tiny presets")

    results, reduction = {}, {}
    for name in args.archs.split(","):
        t0 = time.perf_counter()
        model, tokenizer, env = train(name, args)
        t1 = time.perf_counter()
        seqs = rollouts(model, tokenizer, env, args.prompts, args.n, args.max_tokens, args.seed, args.weights)
        r = mismatch(model, seqs)
        r.update(train_s=round(t1 - t0, 1), total_s=round(time.perf_counter() - t0, 1))
        reduction[name] = round(r["kl_no_r3"] / max(r["kl_r3"], 1e-30), 2)
        results[name] = r
        print(json.dumps({"model": name, **r, "kl_reduction": reduction[name]}), flush=True)
    print(json.dumps({"kl_reduction": reduction, "inference_dtype": "bfloat16", "trainer_dtype": "float32",
                      "sft_steps": args.sft_steps, "routing": routing, "weights": args.weights,
                      "results": results}))


if __name__ == "__main__":
    main()
