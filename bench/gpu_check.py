"""GPU check: on one CUDA GPU, the paths no CPU test reaches, in one command and one JSON line.

Why: CI and development machines have no GPU, so the CUDA paths (bf16 compute, NCCL,
FP8 ``torch._scaled_mm``, the engine's CUDA forwards) are written and refused cleanly on
the CPU but run only where a GPU is lent. This is the one script to run there, sized to
finish in about 8 minutes on one H200 (torch + CUDA, no vLLM, no package registry).

What runs, each section on its own (one that fails records its error and the rest go on):

* ``engine_dense`` / ``engine_moe``: the embedded engine on CUDA in bf16, 64 requests
  (128-token prompts, 128 new tokens, continuous batching), on a Qwen3-shaped dense model
  (the ``qwen3`` plugin's ``0.6b`` preset, random weights) and on a Qwen3-MoE-shaped model
  (about 2.4B parameters, 64 experts top-8): generated tokens/s;
* ``trainer``: the trainer's own ``rl_step`` on the dense model, float32 master weights,
  bf16 compute (``trainer.precision`` auto), the ``single`` strategy: step seconds, trained
  tokens/s, achieved TFLOP/s and MFU (6 x the active matmul parameters per token, over the
  device's dense bf16 peak; attention's own FLOPs are left out, so MFU is a floor);
* ``fsdp``: the same step with the ``fsdp`` strategy (FSDP2, bf16 params / fp32 reduce) on a
  one-rank NCCL group;
* ``fp8``: the same step with ``trainer.fp8`` (block-scaled FP8 through ``torch._scaled_mm``
  on CUDA), and its time against bf16;
* ``run``: ``primerl run --model qwen3 --preset 0.6b --env reverse-text`` end to end on the
  GPU (trainer and engine on CUDA): exit code, wall seconds, the last step's tokens/s and
  reward, and the trainer's MFU over its train time.

Without CUDA it prints one line saying why and exits 2. ``--cpu`` runs the same code on
the CPU with the tiny presets (what ``tests/test_gpu_check.py`` runs, so the script keeps
working between GPU loans; the FP8 section then runs the emulated matmuls).

    python bench/gpu_check.py          # on a GPU: final line {"bench": "gpu_check", ...}
    python bench/gpu_check.py --cpu    # the same sections, tiny presets, on the CPU
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

# dense bf16 peak FLOP/s (no sparsity) by device name
PEAK_BF16 = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12}

REQUESTS, PROMPT, NEW = 64, 128, 128
TRAIN_SAMPLES, TRAIN_LEN, SEQ_LEN, MICRO_ROWS = 64, 512, 2048, 4


def moe_config(tiny: bool) -> dict[str, Any]:
    """A Qwen3-MoE-shaped config: about 2.4B parameters (64 experts top-8), or the tiny preset."""
    from primerl.registry import get_registry

    hf = get_registry().load("model", "qwen3-moe")().hf_config("tiny")
    if tiny:
        return hf
    return {**hf, "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 4,
            "head_dim": 64, "intermediate_size": 2816, "moe_intermediate_size": 512, "num_experts": 64,
            "num_experts_per_tok": 8, "mlp_only_layers": [], "max_position_embeddings": 4096}


def peak_flops(device: str) -> float | None:
    import torch

    if device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def matmul_params(adapter: Any, hf: dict[str, Any]) -> int:
    """Parameters one trained token runs through in matmuls (the planner's count, embeddings out)."""
    shape = adapter.shape(hf)
    return shape.active_params - shape.embed


def engine_section(name: str, hf: dict[str, Any], device: str, tiny: bool) -> dict[str, Any]:
    import torch
    from primerl_embedded.engine import Engine, SamplingParams

    from primerl.registry import get_registry

    adapter = get_registry().load("model", name)()
    dtype = "bfloat16" if device == "cuda" else "float32"
    t0 = time.perf_counter()
    model = adapter.build_from_hf(hf, dtype=dtype, seed=0, device=device).eval()
    built = time.perf_counter() - t0
    requests, prompt, new = (8, 16, 16) if tiny else (REQUESTS, PROMPT, NEW)
    engine = Engine(model, eos_token_ids=[], max_batch_size=requests, max_model_len=prompt + new + 8,
                    kv_slots=requests, num_experts=adapter.moe_layers(hf)[1] or None)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, min(hf["vocab_size"], 256), (prompt,), generator=g).tolist() for _ in range(requests)]
    params = SamplingParams(max_tokens=new, temperature=1.0, seed=1, ignore_eos=True, logprobs=0)

    def round_() -> tuple[float, int, bool]:
        seqs = [s for p in prompts for s in engine.submit(p, params)]
        t = time.perf_counter()
        while engine.has_work():
            engine.step()
        if device == "cuda":
            torch.cuda.synchronize()
        finite = all(all(x == x and x > -1e30 for x in s.logprobs) for s in seqs)
        return time.perf_counter() - t, sum(len(s.output_ids) for s in seqs), finite

    with torch.no_grad():
        round_()  # warm-up
        seconds, tokens, finite = round_()
    params_b = sum(p.numel() for p in model.parameters()) / 1e9
    return {"model": name, "params_b": round(params_b, 3), "dtype": dtype, "build_s": round(built, 1),
            "requests": requests, "generated_tokens": tokens, "seconds": round(seconds, 2),
            "tokens_per_s": round(tokens / seconds, 1), "logprobs_finite": finite}


def train_section(device: str, tiny: bool, *, strategy_name: str, fp8: bool) -> dict[str, Any]:
    """Two rl_steps (the second timed) of the dense model on ``device``, as the trainer runs them."""
    import attrs
    import torch

    from primerl.algorithms import build_loss
    from primerl.config import RunConfig
    from primerl.parallel import device_mesh
    from primerl.registry import get_registry
    from primerl.samples import Sample
    from primerl.trainer.main import load_parallelism
    from primerl.trainer.optim import make_optimizer
    from primerl.trainer.packing import pack
    from primerl.trainer.step import rl_step

    adapter = get_registry().load("model", "qwen3")()
    hf = adapter.hf_config("tiny" if tiny else "0.6b")
    samples_n, length, seq_len = (8, 48, 256) if tiny else (TRAIN_SAMPLES, TRAIN_LEN, SEQ_LEN)
    cfg = RunConfig()
    cfg.trainer = attrs.evolve(cfg.trainer, device=device, seq_len=seq_len, micro_batch_rows=MICRO_ROWS, fp8=fp8,
                               parallelism=strategy_name)
    model = adapter.build_from_hf(hf, dtype="float32", seed=0, device="cpu").train()
    if fp8:
        from primerl.models.fp8_matmul import apply_fp8_matmuls_

        apply_fp8_matmuls_(model)
    g = torch.Generator().manual_seed(0)
    batch = [Sample(tokens=torch.randint(0, min(hf["vocab_size"], 256), (length,), generator=g).tolist(),
                    loss_mask=[0] * 16 + [1] * (length - 16), logprobs=[-1.0] * length,
                    advantage=(i % 4 - 1.5) / 2, task_id=str(i // 4)) for i in range(samples_n)]
    packed = pack(batch, seq_len)
    strategy = load_parallelism(strategy_name)
    owned = False
    if strategy_name == "fsdp" and device == "cuda":
        import torch.distributed as dist

        if not dist.is_initialized():  # a one-rank NCCL group: FSDP2's collectives on CUDA tensors
            dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                                    device_id=torch.device("cuda", torch.cuda.current_device()))
            owned = True
    try:
        settings = cfg.trainer.parallel.resolved(1)
        with device_mesh(strategy.mesh_shape(1, settings), device) as mesh:
            model, optimizer, layout = strategy.parallelize(model, mesh, lambda m: make_optimizer(m, 1e-5, 0.0))
            times, stats = [], {}
            for _ in range(2):
                if device == "cuda":
                    torch.cuda.synchronize()
                t = time.perf_counter()
                stats = rl_step(model, optimizer, packed, build_loss("default"), cfg, strategy)
                if device == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
            peak_mem = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
    finally:
        if owned:
            import torch.distributed as dist

            dist.destroy_process_group()
    tokens = sum(len(s.tokens) for s in batch)
    flops = 6 * matmul_params(adapter, hf) * tokens / times[-1]
    peak = peak_flops(device)
    return {"strategy": layout.describe(), "fp8": fp8, "precision": cfg.trainer.resolved_precision(),
            "tokens": tokens, "first_step_s": round(times[0], 3), "step_s": round(times[-1], 3),
            "tokens_per_s": round(tokens / times[-1], 1), "tflops": round(flops / 1e12, 2),
            "mfu": round(flops / peak, 4) if peak else None, "loss": round(float(stats["loss"]), 5),
            "grad_norm": round(float(stats["grad_norm"]), 5),
            "peak_memory_gib": round(peak_mem, 2) if peak_mem is not None else None}


def run_section(device: str, tiny: bool) -> dict[str, Any]:
    """``primerl run`` on ``device``: the trainer and the engine in their own processes."""
    out = Path(tempfile.mkdtemp(prefix="primerl-gpu-check-")) / "run"
    preset = "tiny" if tiny else "0.6b"
    steps = 2 if tiny else 5
    cmd = [sys.executable, "-m", "primerl.cli", "run", "--model", "qwen3", "--model.preset", preset, "--env", "reverse-text",
           "--max-steps", str(steps), "--sft.steps", "2", "--output-dir", str(out),
           "--trainer.device", device, "--inference.device", device]
    if device == "cuda":
        cmd += ["--inference.dtype", "bfloat16"]
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300 if not tiny else 600)
    wall = time.perf_counter() - t
    result: dict[str, Any] = {"returncode": r.returncode, "wall_s": round(wall, 1), "steps": steps}
    if r.returncode != 0:
        result["error"] = (r.stderr.strip().splitlines() or ["(no output)"])[-1][:300]
        return result
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    from primerl.registry import get_registry

    adapter = get_registry().load("model", "qwen3")()
    trained = sum(row["trainer/tokens"] for row in rows)
    train_s = sum(row["time/train"] for row in rows)
    peak = peak_flops(device)
    flops = 6 * matmul_params(adapter, adapter.hf_config(preset)) * trained / max(train_s, 1e-9)
    result.update({"reward_last": round(last["reward/mean"], 3), "throughput_tokens_per_s":
                   round(last["throughput/sampled_tokens_per_s"], 1), "trainer_tokens_per_s": round(trained / train_s, 1),
                   "trainer_mfu": round(flops / peak, 4) if peak else None,
                   "mismatch_kl_last": last["mismatch_kl"]})
    return result


def section(fn: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    t = time.perf_counter()
    try:
        out = fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - a failed section is reported, the others still run
        out = {"error": f"{type(exc).__name__}: {exc}"[:500],
               "where": traceback.format_exc().strip().splitlines()[-3][:300]}
    out["section_s"] = round(time.perf_counter() - t, 1)
    print(json.dumps(out), file=sys.stderr, flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="run every section on the CPU with the tiny presets")
    parser.add_argument("--only", default="", help="comma-separated sections (engine_dense,engine_moe,trainer,"
                                                    "fsdp,fp8,run)")
    args = parser.parse_args()
    import torch

    if not args.cpu and not torch.cuda.is_available():
        why = "a CPU build of torch" if torch.version.cuda is None else "no CUDA device visible"
        print(f"gpu_check: needs a CUDA GPU ({why}, torch {torch.__version__}); --cpu runs the same sections "
              f"on the CPU with the tiny presets", file=sys.stderr)
        return 2
    device, tiny = ("cpu", True) if args.cpu else ("cuda", False)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from primerl.registry import get_registry

    dense_hf = get_registry().load("model", "qwen3")().hf_config("tiny" if tiny else "0.6b")
    sections = {
        "engine_dense": lambda: section(engine_section, "qwen3", dense_hf, device, tiny),
        "engine_moe": lambda: section(engine_section, "qwen3-moe", moe_config(tiny), device, tiny),
        "trainer": lambda: section(train_section, device, tiny, strategy_name="single", fp8=False),
        "fsdp": lambda: section(train_section, device, tiny, strategy_name="fsdp", fp8=False),
        "fp8": lambda: section(train_section, device, tiny, strategy_name="single", fp8=True),
        "run": lambda: section(run_section, device, tiny),
    }
    chosen = [s for s in args.only.split(",") if s] or list(sections)
    unknown = sorted(set(chosen) - set(sections))
    if unknown:
        print(f"gpu_check: unknown sections {unknown}; choose from {', '.join(sections)}", file=sys.stderr)
        return 2
    t = time.perf_counter()
    results = {name: sections[name]() for name in chosen}
    if "fp8" in results and "trainer" in results and "step_s" in results["fp8"] and "step_s" in results["trainer"]:
        results["fp8"]["bf16_over_fp8"] = round(results["trainer"]["step_s"] / results["fp8"]["step_s"], 3)
    info = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
            "cuda": torch.version.cuda, "total_s": round(time.perf_counter() - t, 1)}
    ok = all("error" not in r for r in results.values())
    print(json.dumps({"bench": "gpu_check", "ok": ok, **info, **results}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
