"""How much of the machine the RL loop uses: useful FLOPs per second over the matmul rate.

On the tiny presets a step is mostly per-op overhead (bench/vs_trl.py), which says how fast
the dev mode is, not how well the loop uses hardware. This bench runs ``primerl run`` on a
``small`` preset (hidden 512-1024, tens of millions of parameters: matmuls dominate a step
on one core) and asks how many of the FLOPs the two cores could do the loop turned into
training and generation:

* **useful FLOPs**: trainer 6 x active params x the tokens it computes (``trainer/tokens``:
  a group's shared prompt once under ``trainer.share_prompts``, no padding); inference 2 x
  active params x (prompt tokens prefilled + tokens generated), prefix-cache hits and a
  group's sibling prompts (copied, not computed) not counted. Active parameters are those a
  token's forward multiplies by (bench/vs_trl.py's ``active_params``: routed experts count
  top_k / E; the embedding table and the DSA indexer do not count). Attention's
  quadratic term is left out (prompts here are ~20 tokens).
* **the machine's matmul rate**: float32 GEMMs of the model's own weight shapes, [2048
  tokens, in] @ [in, out] for every projection and expert (an expert's rows top_k / E of
  them), one thread per core, on **both cores at once** (two processes, started together),
  measured before and after the runs in this process tree; the median. ``decode_gflops``
  is the same on a decode step's shapes (64 rows), for reference.
* per role (trainer, inference, orchestrator): its useful GFLOP/s, its ``utilisation``
  (that over one core's rate), and where its wall time goes: ``matmul`` (its useful FLOPs
  at the machine's rate), ``other_busy`` (CPU time beyond that: non-GEMM ops, per-op
  overhead, skinny GEMMs below peak, Python, HTTP), ``idle`` (waiting);
* ``loop_utilisation``: both roles' useful FLOPs per second over the two cores' rate;
  ``cores_busy``: each core's busy share (``/proc/stat``) over the same window.

TRL's GRPOTrainer runs the same preset and task (bench/vs_trl.py's runner: its threads
chosen by a short probe, the faster of eager and sdpa attention not probed: sdpa), its
useful FLOPs counted the same way (it prefills every sample's prompt and trains every
sample's whole sequence), and its utilisation over the same two-core rate, side by side.
Both are timed from the end of their first step to the end of their last. Each system
runs as configured for a matmul-bound model: TRL with its probed threads, primerl with
``--trainer.threads 2`` (the trainer's threads over both cores, overlapping the core the
engine leaves idle, as ``trainer.threads`` advises); ``--primerl-args ""`` measures the
default share (one core each).

``--model llama --checkpoint smollm2-135m-instruct``: a real model, trained as
examples/smollm2-reverse-text.toml trains it (lr 1e-5, temperature 1, groups of 8, no
warm-up). Its output head (49,152 x 576, tied to the embedding) is counted where the loop
needs it, as part of the model's work: the trainer's head at the loss's tokens
(``trainer/loss_tokens``, the only positions it computes the head at), the engine's at each
generated token (a prefill computes it at its last position only); the body (every other
weight) at every token as above. The machine's rate adds the head's shape. TRL is not run
in this mode (bench/vs_trl_smollm2.py compares the two on this model).

    pip install -r requirements-bench.txt      # trl
    python bench/utilisation.py                # final line: {"loop_utilisation": ..., "vs_trl": ...}
    python bench/utilisation.py --model llama --checkpoint smollm2-135m-instruct
    python bench/utilisation.py --primerl-args "--trainer.threads 2 --orchestrator.async_level 2"
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from vs_trl import GROUP, MAX_NEW, SAMPLES_PER_STEP, active_params, trl_run_stats

GEMM_ROWS, DECODE_ROWS = 2048, 64
ROLES = ("trainer", "inference", "orchestrator")


# ---- the machine's matmul rate on the model's shapes ----------------------------------------
def build(model_name: str, preset: str, checkpoint: str | None):
    """The model measured: a preset (random weights) or ``checkpoint``."""
    from primerl.models import ModelConfig
    from primerl.registry import get_registry

    cfg = ModelConfig(name=model_name, preset=preset, seed=0) if checkpoint is None else \
        ModelConfig(name=model_name, checkpoint=checkpoint)
    return get_registry().load("model", model_name)().build(cfg)


def tied_head(model) -> tuple[int, int] | None:
    """(in, out) of the output head when it is the embedding table (then the shapes and
    active parameters below, which skip the embedding, leave it out)."""
    emb = model.input_embeddings().weight  # [vocab, hidden]
    return (emb.shape[1], emb.shape[0]) if model.lm_head.weight is emb else None


def weight_shapes(model_name: str, preset: str, checkpoint: str | None = None) -> list[tuple[int, int, int]]:
    """(rows, in, out) of each GEMM a token's forward runs, at GEMM_ROWS tokens: every 2-D
    weight but the embedding and the indexer, each expert at its share of the rows (and a
    head tied to the embedding, with ``checkpoint``)."""
    from primerl.models.experts import Experts

    model = build(model_name, preset, checkpoint)
    k = model.config.num_experts_per_tok
    skip = {id(model.input_embeddings().weight)} | {id(p) for n, p in model.named_parameters() if ".indexer." in n}
    shapes = []
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if id(p) in skip or p.dim() < 2:
                continue
            skip.add(id(p))
            if isinstance(module, Experts):  # [E, out, in]: each expert sees rows x k / E tokens
                shapes += [(max(1, GEMM_ROWS * k // p.shape[0]), p.shape[2], p.shape[1])] * p.shape[0]
            else:  # [out, in]
                shapes.append((GEMM_ROWS, p.shape[1], p.shape[0]))
    if checkpoint is not None and (tied := tied_head(model)):
        shapes.append((GEMM_ROWS, *tied))
    return shapes


def body_and_head_params(model) -> tuple[int, int]:
    """A dense checkpoint's parameters a token's forward multiplies by, the output head apart:
    (body: every weight but the embedding and the head, head)."""
    emb, head = model.input_embeddings().weight, model.lm_head.weight
    body = sum(p.numel() for p in model.parameters() if p.dim() >= 2 and p is not emb and p is not head)
    return body, head.numel()


def gemm_gflops(shapes: list[tuple[int, int, int]], rows: int | None = None, seconds: float = 2.0) -> float:
    """One thread's float32 GFLOP/s over ``shapes`` (``rows`` replacing their row counts,
    experts scaled alike), repeated for about ``seconds``."""
    import torch

    torch.set_num_threads(1)
    scale = 1.0 if rows is None else rows / GEMM_ROWS
    mats = [(torch.randn(max(1, round(m * scale)), i), torch.randn(i, o)) for m, i, o in shapes]
    flops = sum(2 * x.shape[0] * x.shape[1] * w.shape[1] for x, w in mats)
    for x, w in mats:
        x @ w
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for x, w in mats:
            x @ w
        n += 1
    return flops * n / (time.perf_counter() - t0) / 1e9


def machine_gflops(model_args: list[str]) -> dict[str, float]:
    """Both cores at once, one GEMM process each: their summed rate on the training shapes,
    and on a decode step's (``DECODE_ROWS``)."""
    cmd = [sys.executable, __file__, "--gemm-only", *model_args]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) for _ in range(os.cpu_count() or 1)]
    outs = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
    return {"gflops": sum(o["gflops"] for o in outs), "per_core": statistics.mean(o["gflops"] for o in outs),
            "decode_per_core": statistics.mean(o["decode_gflops"] for o in outs)}


# ---- what a run's processes and cores did -------------------------------------------------
def cpu_seconds(pid: int) -> dict[int, tuple[str, float]]:
    """Each process under the run: pid -> (role, CPU seconds so far, user + system); a
    process's role is its own or that of its nearest ancestor with one (the orchestrator's
    env workers are the orchestrator's)."""
    tick = os.sysconf("SC_CLK_TCK")
    procs: dict[int, tuple[int, str | None, float]] = {}  # pid -> (parent, role, CPU seconds)
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            args = [a.decode() for a in (proc / "cmdline").read_bytes().split(b"\0")]
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        kind = next((a for a in args[:5] if a in ROLES), None)
        procs[int(proc.name)] = (int(fields[1]), kind, (int(fields[11]) + int(fields[12])) / tick)
    seconds = {}
    for p, (_, kind, cpu) in procs.items():
        q, found, under = p, kind, False
        while q in procs and q > 1:
            if q == pid:
                under = True
                break
            found = found or procs[q][1]
            q = procs[q][0]
        if under and found:
            seconds[p] = (found, cpu)
    return seconds


def cpu_between(first: dict[int, tuple[str, float]], last: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds each role spent between two :func:`cpu_seconds` (a process that ended in
    between is left out; one that started counts from zero)."""
    spent = dict.fromkeys(ROLES, 0.0)
    for pid, (kind, seconds) in last.items():
        spent[kind] += seconds - first.get(pid, (kind, 0.0))[1]
    return spent


def core_times() -> list[tuple[float, float]]:
    """(busy, total) jiffies of each core (``/proc/stat``)."""
    out = []
    for line in Path("/proc/stat").read_text().splitlines():
        if re.match(r"cpu\d+ ", line):
            v = [int(x) for x in line.split()[1:]]
            idle = v[3] + v[4]
            out.append((sum(v[:8]) - idle, sum(v[:8])))
    return out


def engine_counters(port: int) -> dict[str, float]:
    """The embedded engine's token counters (its Prometheus ``/metrics``)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    names = {"primerl_prompt_tokens_total": "prompt", "primerl_prefix_cache_hit_tokens_total": "hits",
             "primerl_generation_tokens_total": "generated"}
    found = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] in names:
            found[names[parts[0]]] = float(parts[1])
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Snapshot:
    def __init__(self, pid: int, port: int):
        self.at = time.time()
        self.cpu = cpu_seconds(pid)
        self.cores = core_times()
        self.engine = engine_counters(port)


def primerl_run(out: Path, model: list[str], steps: int, extra: list[str]) -> dict:
    """One ``primerl run`` (``model``: its --model options): snapshots at the end of its first
    step and of its last."""
    port = free_port()
    cmd = [sys.executable, "-m", "primerl.cli", "run", *model,
           "--env", "reverse-text", "--output-dir", str(out), "--max-steps", str(steps + 1), "--sft.steps", "0",
           "--env.max_words", "1", "--orchestrator.batch_size", str(SAMPLES_PER_STEP),
           "--orchestrator.group_size", str(GROUP), "--orchestrator.max_tokens", str(MAX_NEW),
           "--orchestrator.temperature", "1.0", "--inference.port", str(port), *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    metrics = out / "metrics.jsonl"
    snaps: list[Snapshot] = []
    seen: dict[int, tuple[str, float]] = {}  # each process's CPU when last looked at (the orchestrator
    polled = 0.0                             # ends before the trainer's last step does)
    deadline = time.time() + 3600
    while proc.poll() is None and time.time() < deadline:
        done = len(metrics.read_text().splitlines()) if metrics.exists() else 0
        if (done >= 1 and not snaps) or (done >= steps + 1 and len(snaps) == 1):
            snaps.append(Snapshot(proc.pid, port))
            snaps[-1].cpu = {**seen, **snaps[-1].cpu}
        elif len(snaps) == 1 and time.time() - polled > 0.5:
            seen.update(cpu_seconds(proc.pid))
            polled = time.time()
        time.sleep(0.01)
    if proc.poll() is None:
        proc.kill()
    if proc.wait() != 0 or len(snaps) != 2:
        raise SystemExit(f"primerl run failed (exit {proc.returncode}); see {out / 'logs'}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    first, last = snaps
    wall = rows[-1]["time/end"] - rows[0]["time/end"]
    e0, e1 = first.engine, last.engine
    cores = [(b1 - b0) / max(t1 - t0, 1) for (b0, t0), (b1, t1) in zip(first.cores, last.cores)]
    return {
        "wall_s": wall, "steps": len(rows) - 1,
        "rollouts_per_s": SAMPLES_PER_STEP * (len(rows) - 1) / wall,
        "trainer_tokens": sum(r["trainer/tokens"] for r in rows[1:]),
        "loss_tokens": sum(r["trainer/loss_tokens"] for r in rows[1:]),
        "trainer_s": sum(r["time/train"] for r in rows[1:]),
        "publish_s": sum(r.get("time/publish", 0.0) for r in rows[1:]),
        "wait_s": sum(r["time/wait"] for r in rows[1:]),
        "prefilled": (e1["prompt"] - e0["prompt"]) - (e1["hits"] - e0["hits"]),
        "generated": e1["generated"] - e0["generated"],
        "prompt_tokens": e1["prompt"] - e0["prompt"],
        "cpu_s": cpu_between(first.cpu, last.cpu),
        "cores_busy": cores,
        "off_policy": statistics.mean(r["off_policy/mean"] for r in rows[1:]),
        "snap_s": last.at - first.at,
    }


def role(flops: float, cpu_s: float, wall: float, per_core: float) -> dict:
    """A role's useful rate and where its time went, in cores over the window: ``matmul``
    (its useful FLOPs at one core's rate: its ``utilisation``), ``other_busy`` (the rest of
    its CPU time), ``idle`` (of one core: waiting; 0 when it ran more than one thread)."""
    matmul = flops / (per_core * 1e9) / wall
    busy = cpu_s / wall
    return {"gflops": round(flops / wall / 1e9, 2), "utilisation": round(matmul, 3),
            "cores": {"matmul": round(matmul, 3), "other_busy": round(max(busy - matmul, 0.0), 3),
                      "idle": round(max(1 - busy, 0.0), 3)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="glm5")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--checkpoint", default=None, help="a real model instead of the preset (TRL not run)")
    ap.add_argument("--steps", type=int, default=8, help="timed primerl steps (after a first one)")
    ap.add_argument("--trl-steps", type=int, default=3, help="timed TRL steps (after a first one)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--primerl-args", default="--trainer.threads 2", help="more `primerl run` options")
    ap.add_argument("--no-trl", action="store_true", help="primerl only")
    ap.add_argument("--gemm-only", action="store_true", help=argparse.SUPPRESS)  # one core's GEMM rate (a child)
    args = ap.parse_args()
    if args.gemm_only:
        shapes = weight_shapes(args.model, args.preset, args.checkpoint)
        print(json.dumps({"gflops": gemm_gflops(shapes), "decode_gflops": gemm_gflops(shapes, DECODE_ROWS)}))
        return
    args.no_trl = args.no_trl or args.checkpoint is not None
    if not args.no_trl:
        try:
            import trl  # noqa: F401
        except ImportError:
            sys.exit("this benchmark compares with TRL: pip install -r requirements-bench.txt (or pass --no-trl)")

    model_args = ["--model", args.model] + (["--preset", args.preset] if args.checkpoint is None else
                                            ["--checkpoint", args.checkpoint])
    run_model = ["--model", args.model] + (["--model.preset", args.preset] if args.checkpoint is None else
                                           ["--model.checkpoint", args.checkpoint])
    if args.checkpoint is None:
        active, head = active_params(args.preset), 0  # the preset's head counted in active, at every token
    else:
        active, head = body_and_head_params(build(args.model, args.preset, args.checkpoint))
    rates = [machine_gflops(model_args)]
    ours, theirs, threads = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            ours.append(primerl_run(Path(tmp) / f"primerl{r}", run_model, args.steps, shlex.split(args.primerl_args)))
            rates.append(machine_gflops(model_args))
            print(f"round {r + 1}: primerl {ours[-1]['rollouts_per_s']:.2f} rollouts/s", flush=True)
            if args.no_trl:
                continue
            probe = {t: trl_run_stats(Path(tmp) / f"probe{t}_{r}", 1, "sdpa", t, args.preset)["rollouts_per_s"]
                     for t in sorted({1, os.cpu_count() or 1})}
            threads.append(max(probe, key=probe.get))
            theirs.append(trl_run_stats(Path(tmp) / f"trl{r}", args.trl_steps, "sdpa", threads[-1], args.preset))
            rates.append(machine_gflops(model_args))
            print(f"round {r + 1}: TRL {theirs[-1]['rollouts_per_s']:.2f} rollouts/s with {threads[-1]} threads "
                  f"(probe {probe})", flush=True)

    machine = statistics.median(x["gflops"] for x in rates)
    per_core = statistics.median(x["per_core"] for x in rates)
    run = min(ours, key=lambda o: abs(o["rollouts_per_s"] - statistics.median(x["rollouts_per_s"] for x in ours)))
    wall = run["wall_s"]
    # the body at every token; a checkpoint's head where the loop computes it (module docstring)
    f_train = 6 * active * run["trainer_tokens"] + 6 * head * run["loss_tokens"]
    f_infer = 2 * active * (run["prefilled"] + run["generated"]) + 2 * head * run["generated"]
    roles = {"trainer": role(f_train, run["cpu_s"]["trainer"], wall, per_core),
             "inference": role(f_infer, run["cpu_s"]["inference"], wall, per_core),
             "orchestrator": role(0.0, run["cpu_s"]["orchestrator"], wall, per_core)}
    roles["trainer"]["s_per_step"] = {"train": round(run["trainer_s"] / run["steps"], 3),
                                      "of_which_publish": round(run["publish_s"] / run["steps"], 3),
                                      "wait": round(run["wait_s"] / run["steps"], 3)}
    roles["inference"]["tokens_per_step"] = {k: round(run[k] / run["steps"]) for k in ("prompt_tokens", "prefilled",
                                                                                        "generated")}
    result = {
        "bench": "utilisation", "model": args.model, **({"preset": args.preset} if args.checkpoint is None else
                                                         {"checkpoint": args.checkpoint, "head_params": head}),
        "active_params": active,
        "steps": run["steps"], "rounds": args.rounds,
        "primerl_args": args.primerl_args,
        "machine_gflops": round(machine, 1), "per_core_gflops": round(per_core, 1),
        "decode_gflops": round(statistics.median(x["decode_per_core"] for x in rates), 1),
        "rollouts_per_s": round(run["rollouts_per_s"], 3), "off_policy_mean": round(run["off_policy"], 2),
        "roles": roles, "cores_busy": [round(c, 3) for c in run["cores_busy"]],
        "loop_gflops": round((f_train + f_infer) / wall / 1e9, 1),
        "loop_utilisation": round((f_train + f_infer) / wall / 1e9 / machine, 3),
    }
    if theirs:
        t = min(theirs, key=lambda o: abs(o["rollouts_per_s"] - statistics.median(x["rollouts_per_s"] for x in theirs)))
        tokens = t["prompt_tokens_per_step"] + t["completion_tokens_per_step"]
        steps_per_s = t["rollouts_per_s"] / SAMPLES_PER_STEP
        f_trl = (2 * active * tokens + 6 * active * tokens) * steps_per_s  # generate (prefill + decode), then train
        result["trl"] = {"rollouts_per_s": round(t["rollouts_per_s"], 3), "threads": threads,
                         "tokens_per_step": round(tokens), "gflops": round(f_trl / 1e9, 1),
                         "loop_utilisation": round(f_trl / 1e9 / machine, 3)}
        result["vs_trl"] = {"rollouts_per_s": round(run["rollouts_per_s"] / t["rollouts_per_s"], 2),
                            "loop_utilisation": round(result["loop_utilisation"] / max(result["trl"]["loop_utilisation"],
                                                                                       1e-9), 2)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
