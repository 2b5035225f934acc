"""Block-scaled FP8 (``trainer.fp8``, the DeepSeek-V3 recipe): quantization error and training.

Two measurements, one command:

* **error**: relative error ``||dq(q(W)) - W|| / ||W||`` of e4m3 quantization with one scale
  per 128 x 128 block (weights) or 1 x 128 tile (activations, gradients) against one scale
  per tensor (``amax / 448``, current scaling), on (1) synthetic weights shaped like trained
  LLM weights: Gaussian plus a few input channels (columns) 10x and 100x larger and a few
  100x single outliers; (2) a column-outlier sweep from 10x to 100,000x; (3) the weights of
  the tiny model trained in part 2; (4) that model's real linear inputs and output
  gradients (captured by hooks over one forward/backward), where the tiles' per-token
  scales matter. ``..._over_per_tensor_error`` is blockwise error / per-tensor error
  (below 1: blocks help). For activations and gradients it is reported both over the whole
  tensor and as the mean per-token relative error.
* **training**: the tiny ``qwen3-moe`` preset trained from the same init on the same
  batches of a synthetic next-token task (arithmetic sequences ``a, a+d, a+2d, ...`` mod
  256 with d in 1..8, so the model must read d from the context), AdamW at 3e-3, once in
  float32 (the CPU trainer's precision) and once with every linear and expert in
  block-scaled FP8 (:func:`primerl.models.fp8_matmul.apply_fp8_matmuls_`, emulated on the CPU).
  ``fp8_loss_gap``: the largest relative gap between the two loss curves, each smoothed
  over 10 steps (``fp8_final_loss_gap``: the gap at the last step); final losses are the
  means of the last 10 steps. The noise floor: ``fp32_nudged_loss_gap``, the same gap
  between the float32 run and a float32 run from the init rounded to bfloat16.

    python bench/fp8_blocks.py    # final line: {"blockwise_over_per_tensor_error": ..., "fp8_loss_gap": ...}
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn


def per_tensor(t: torch.Tensor) -> torch.Tensor:
    """t through e4m3 with one scale for the whole tensor, and back (float32)."""
    s = (t.abs().max().float() / 448.0).clamp(min=torch.finfo(torch.float32).tiny)
    return (t.float() / s).clamp(-448, 448).to(FP8).float() * s


def blocks(w: torch.Tensor) -> torch.Tensor:
    from primerl.models.fp8 import dequantize_blockwise, quantize_blockwise

    return dequantize_blockwise(*quantize_blockwise(w))


def tiles(x: torch.Tensor) -> torch.Tensor:
    from primerl.models.fp8_matmul import dequantize_tiles, quantize_tiles

    return dequantize_tiles(*quantize_tiles(x))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def row_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over rows (tokens) of each row's relative error; all-zero rows are skipped."""
    n = b.norm(dim=-1)
    keep = n > 0
    return float(((a - b).norm(dim=-1)[keep] / n[keep]).mean())


def outlier_weights(rows: int, cols: int, seed: int, col_mags=(10.0, 100.0), n_cols=8, n_points=16,
                    point_mag=100.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian (std 0.02) with ``n_cols`` input channels (columns) per magnitude in
    ``col_mags`` scaled up, and ``n_points`` single weights scaled by ``point_mag``.
    Returns (w [rows, cols], inlier mask [rows, cols]: the entries not scaled)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.02
    inlier = torch.ones(rows, cols, dtype=torch.bool)
    perm = torch.randperm(cols, generator=g)
    for i, mag in enumerate(col_mags):
        c = perm[i * n_cols : (i + 1) * n_cols]
        w[:, c] *= mag
        inlier[:, c] = False
    idx = torch.randint(0, rows * cols, (n_points,), generator=g)
    w.view(-1)[idx] *= point_mag
    inlier.view(-1)[idx] = False
    return w, inlier


def weight_errors(ws: list[torch.Tensor], inliers: list[torch.Tensor] | None = None) -> dict[str, float]:
    """Blockwise vs per-tensor relative error (means over the matrices), and on the inlier
    entries alone when their masks are given."""
    bq, pq = [blocks(w) for w in ws], [per_tensor(w) for w in ws]
    b = [rel(q, w) for q, w in zip(bq, ws, strict=True)]
    p = [rel(q, w) for q, w in zip(pq, ws, strict=True)]
    out = {"blockwise": statistics.mean(b), "per_tensor": statistics.mean(p),
           "ratio": statistics.mean(x / y for x, y in zip(b, p, strict=True))}
    if inliers is not None:
        bi = [rel(q[m], w[m]) for q, w, m in zip(bq, ws, inliers, strict=True)]
        pi = [rel(q[m], w[m]) for q, w, m in zip(pq, ws, inliers, strict=True)]
        out.update(inlier_blockwise=statistics.mean(bi), inlier_per_tensor=statistics.mean(pi),
                   inlier_ratio=statistics.mean(x / y for x, y in zip(bi, pi, strict=True)))
    return out


def ce_like_gradients(tokens: int, channels: int, seed: int) -> torch.Tensor:
    """Output gradients whose per-token size spreads like cross-entropy's (1 - p): log-uniform
    over 1e-6..1 (confidently predicted tokens get tiny gradients). [tokens, channels]."""
    g = torch.Generator().manual_seed(seed)
    size = 10.0 ** (-6 * torch.rand(tokens, 1, generator=g))
    return torch.randn(tokens, channels, generator=g) * size


def tile_errors(ts: list[torch.Tensor]) -> dict[str, float]:
    """1 x 128 tiles along the last dim vs per tensor, on [tokens, channels] matrices."""
    t_f, p_f = [rel(tiles(t), t) for t in ts], [rel(per_tensor(t), t) for t in ts]
    t_r, p_r = [row_rel(tiles(t), t) for t in ts], [row_rel(per_tensor(t), t) for t in ts]
    return {"tiles": statistics.mean(t_f), "per_tensor": statistics.mean(p_f),
            "ratio": statistics.mean(x / y for x, y in zip(t_f, p_f, strict=True)),
            "per_token_tiles": statistics.mean(t_r), "per_token_per_tensor": statistics.mean(p_r),
            "per_token_ratio": statistics.mean(x / y for x, y in zip(t_r, p_r, strict=True))}


# ---------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------


def batches(steps: int, batch: int, seq: int, seed: int) -> list[torch.Tensor]:
    """Arithmetic sequences mod 256: start a, step d in 1..8 (the model reads d off the context)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        a = torch.randint(0, 256, (batch, 1), generator=g)
        d = torch.randint(1, 9, (batch, 1), generator=g)
        out.append((a + d * torch.arange(seq)) % 256)  # [batch, seq]
    return out


def train(model: torch.nn.Module, data: list[torch.Tensor], lr: float, tag: str) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8)
    B, S = data[0].shape
    positions, lengths = torch.arange(S).expand(B, S), torch.full((B,), S)
    losses = []
    t0 = time.perf_counter()
    for i, ids in enumerate(data):
        logits = model(ids, positions, lengths).logits[:, :-1]  # [B, S-1, V]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        if (i + 1) % 50 == 0 or i + 1 == len(data):
            print(json.dumps({"train": tag, "step": i + 1, "loss": round(statistics.mean(losses[-10:]), 4),
                              "s": round(time.perf_counter() - t0, 1)}), flush=True)
    return losses


def smooth(xs: list[float], k: int = 10) -> list[float]:
    return [statistics.mean(xs[max(0, i - k + 1) : i + 1]) for i in range(len(xs))]


def captured(model: torch.nn.Module, ids: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every nn.Linear's input and output gradient ([tokens, channels]) over one forward and
    backward of ``model`` (float32) on ``ids``; lm_head excluded (it stays high precision)."""
    acts, grads, handles = [], [], []
    for name, m in model.named_modules():
        if type(m) is torch.nn.Linear and name != "lm_head":
            handles.append(m.register_forward_hook(lambda _m, inp, _out: acts.append(inp[0].detach().flatten(0, -2))))
            handles.append(m.register_full_backward_hook(
                lambda _m, _gi, go: grads.append(go[0].detach().flatten(0, -2))))
    B, S = ids.shape
    logits = model(ids, torch.arange(S).expand(B, S), torch.full((B,), S)).logits[:, :-1]
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).backward()
    for h in handles:
        h.remove()
    model.zero_grad(set_to_none=True)
    return acts, grads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-moe")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args()

    from primerl.models import ModelConfig
    from primerl.models.fp8_matmul import apply_fp8_matmuls_
    from primerl.registry import get_registry

    torch.set_num_threads(1)  # as in `primerl run` on 2 cores: the trainer gets one
    result: dict = {"bench": "fp8_blocks", "model": args.model, "steps": args.steps}

    # 1. quantization error, synthetic weights and gradients
    synth = weight_errors(*zip(*[outlier_weights(1024, 1024, seed) for seed in range(4)], strict=True))
    print(json.dumps({"error": "synthetic weights (10x, 100x columns; 100x points)", **synth}), flush=True)
    sweep, sweep_inliers = {}, {}
    for mag in (10, 100, 1000, 10_000, 100_000):
        e = weight_errors(*zip(*[outlier_weights(1024, 1024, seed, col_mags=(mag,), n_points=0)
                                 for seed in range(2)], strict=True))
        sweep[str(mag)], sweep_inliers[str(mag)] = round(e["ratio"], 3), round(e["inlier_ratio"], 3)
        print(json.dumps({"error": f"weights with {mag}x columns", **e}), flush=True)
    ce = tile_errors([ce_like_gradients(2048, 1024, seed) for seed in range(2)])
    print(json.dumps({"error": "synthetic gradients, per-token size log-uniform 1e-6..1", **ce}), flush=True)

    # 2. training, float32 vs FP8, same init and batches
    adapter = get_registry().load("model", args.model)()
    base = adapter.build(ModelConfig(name=args.model, preset="tiny", seed=0)).train()
    data = batches(args.steps, args.batch, args.seq, seed=1)
    fp32_model = copy.deepcopy(base)
    fp32_losses = train(fp32_model, data, args.lr, "fp32")
    fp8_model = copy.deepcopy(base)
    converted = apply_fp8_matmuls_(fp8_model)
    print(json.dumps({"fp8_modules": len(converted)}), flush=True)
    fp8_losses = train(fp8_model, data, args.lr, "fp8")
    s32, s8 = smooth(fp32_losses), smooth(fp8_losses)
    gaps = [abs(a - b) / b for a, b in zip(s8, s32, strict=True)]
    # the noise floor: float32 again from the init rounded to bfloat16 (a 2^-9 nudge, far
    # below FP8's), so that fp8_loss_gap can be read against plain run-to-run divergence
    nudged = copy.deepcopy(base)
    with torch.no_grad():
        for p in nudged.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    s_nudged = smooth(train(nudged, data, args.lr, "fp32, bf16-rounded init"))
    floor = [abs(a - b) / b for a, b in zip(s_nudged, s32, strict=True)]

    # 3. the trained model's weights, real activations and gradients
    mats = []  # every matrix FP8 training quantizes (experts one by one)
    for n, p in fp32_model.named_parameters():
        if p.dim() >= 2 and not n.endswith(("embed_tokens.weight", "lm_head.weight", "gate.weight")):
            mats += [p.detach()] if p.dim() == 2 else list(p.detach().unbind(0))
    trained = weight_errors(mats)
    print(json.dumps({"error": "trained tiny model weights", **trained}), flush=True)
    acts, grads = captured(fp32_model, batches(1, args.batch, args.seq, seed=2)[0])
    act_err, grad_err = tile_errors(acts), tile_errors(grads)
    print(json.dumps({"error": "trained model linear inputs (1x128 tiles)", **act_err}), flush=True)
    print(json.dumps({"error": "trained model output gradients (1x128 tiles)", **grad_err}), flush=True)

    result.update({
        "blockwise_over_per_tensor_error": round(synth["ratio"], 3),
        "blockwise_over_per_tensor_inlier_error": round(synth["inlier_ratio"], 3),
        "blockwise_over_per_tensor_error_by_outlier": sweep,
        "blockwise_over_per_tensor_inlier_error_by_outlier": sweep_inliers,
        "trained_weights_blockwise_over_per_tensor_error": round(trained["ratio"], 3),
        "activations_tiles_over_per_tensor_error": round(act_err["ratio"], 3),
        "activations_tiles_over_per_tensor_per_token_error": round(act_err["per_token_ratio"], 3),
        "gradients_tiles_over_per_tensor_error": round(grad_err["ratio"], 3),
        "gradients_tiles_over_per_tensor_per_token_error": round(grad_err["per_token_ratio"], 3),
        "ce_gradients_tiles_over_per_tensor_per_token_error": round(ce["per_token_ratio"], 3),
        "fp32_initial_loss": round(statistics.mean(fp32_losses[:10]), 4),
        "fp32_final_loss": round(statistics.mean(fp32_losses[-10:]), 4),
        "fp8_final_loss": round(statistics.mean(fp8_losses[-10:]), 4),
        "fp8_loss_gap": round(max(gaps), 4),
        "fp8_final_loss_gap": round(gaps[-1], 4),
        "fp32_nudged_loss_gap": round(max(floor), 4),
        "fp32_nudged_final_loss_gap": round(floor[-1], 4),
    })
    print(json.dumps(result))


if __name__ == "__main__":
    main()
