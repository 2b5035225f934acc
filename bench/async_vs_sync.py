"""Asynchronous vs synchronous RL under long-tail rollouts: steps per minute, side by side.

The same run twice — reverse-text on the tiny GLM-5 preset, 64 samples a step — once with
``async_level = 0`` (synchronous: every batch waits for its slowest rollout, and inference
idles while the trainer steps) and once with ``async_level = 2`` (batches are filled by
the first groups to finish; inference keeps generating while the trainer steps). Each
reward call sleeps a log-normal time (median ``--latency`` seconds, p99 about 20x the
median), as a slow verifier or tool would. Steps per minute come from the trainer's own
step timestamps in ``metrics.jsonl``, after a warm-up step.

The **hiding ratio** says how much of that latency the pipeline hides: steps per minute
with the latency over steps per minute of the same run without it (1.0 = fully hidden), at
``--async-level`` (2) and at the default ``async_level`` 1. A rollout can only be hidden
while it is at most ``max_off_policy_steps`` (4) versions old when it lands, so a tail
longer than about 4 steps cannot be: on the tiny preset a step takes ~0.3 s and the p99
~6 s; ``--preset small`` (steps of ~2.5 s, matmul-bound) is the regime of real runs,
where a step outlasts a slow tool call.

    python bench/async_vs_sync.py       # final line: {"ratio": async / sync steps per minute, "hiding_ratio": ...}
    python bench/async_vs_sync.py --preset small
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run(out: Path, async_level: int, steps: int, latency: float, preset: str = "tiny") -> tuple[float, int, float]:
    """Steps per minute of one run (between the first and the last step), samples dropped
    as stale, and the mean staleness of the samples trained on; ``latency`` 0: no sleep."""
    cmd = [sys.executable, "-m", "primerl.cli", "run", "--model", "glm5", "--model.preset", preset, "--env", "reverse-text",
           "--output-dir", str(out), "--max-steps", str(steps + 1), "--sft.steps", "0",
           "--orchestrator.async_level", str(async_level), "--orchestrator.max_off_policy_steps", "4",
           "--orchestrator.max_concurrent", "256", "--inference.port", "0",
           *(["--env.latency_s", str(latency), "--env.latency_tail", "20"] if latency else [])]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, timeout=1200)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    stamps = [r["time/end"] for r in rows]
    dropped = sum(r["dropped_stale"] for r in rows)
    staleness = sum(r["off_policy/mean"] for r in rows) / len(rows)
    return 60.0 * (len(stamps) - 1) / (stamps[-1] - stamps[0]), dropped, staleness


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--latency", type=float, default=0.3, help="median reward latency in seconds")
    ap.add_argument("--async-level", type=int, default=2)
    ap.add_argument("--preset", default="tiny", help="the GLM-5 preset (tiny, small)")
    args = ap.parse_args()
    hiding: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.time()
        sync, sync_dropped, _ = run(Path(tmp) / "sync", 0, args.steps, args.latency, args.preset)
        asyn, async_dropped, async_staleness = run(Path(tmp) / "async", args.async_level, args.steps, args.latency,
                                                   args.preset)
        print(f"sync (async_level 0): {sync:.1f} steps/min; async (async_level {args.async_level}): "
              f"{asyn:.1f} steps/min; {time.time() - t0:.0f}s in all", flush=True)
        for level in sorted({args.async_level, 1}, reverse=True):
            slow = asyn if level == args.async_level else run(Path(tmp) / f"slow{level}", level, args.steps,
                                                              args.latency, args.preset)[0]
            quick = run(Path(tmp) / f"quick{level}", level, args.steps, 0.0, args.preset)[0]
            hiding[str(level)] = {"with_latency": round(slow, 2), "without": round(quick, 2),
                                  "hiding_ratio": round(slow / quick, 3)}
            print(f"async_level {level}: {slow:.1f} steps/min with the latency, {quick:.1f} without", flush=True)
    print(json.dumps({"bench": "async_vs_sync", "preset": args.preset, "steps": args.steps,
                      "latency_median_s": args.latency,
                      "sync_steps_per_min": round(sync, 2), "async_steps_per_min": round(asyn, 2),
                      "async_level": args.async_level, "async_dropped_stale": async_dropped,
                      "async_mean_staleness": round(async_staleness, 2), "sync_dropped_stale": sync_dropped,
                      "ratio": round(asyn / sync, 2), "steps_per_min_by_async_level": hiding,
                      "hiding_ratio": hiding[str(args.async_level)]["hiding_ratio"]}))


if __name__ == "__main__":
    main()
