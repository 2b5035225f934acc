"""Asynchronous vs synchronous RL under long-tail rollouts: steps per minute, side by side.

The same run twice — reverse-text on the tiny GLM-5 preset, 64 samples a step — once with
``async_level = 0`` (synchronous: every batch waits for its slowest rollout, and inference
idles while the trainer steps) and once with ``async_level = 2`` (batches are filled by
the first groups to finish; inference keeps generating while the trainer steps). Each
reward call sleeps a log-normal time (median ``--latency`` seconds, p99 about 20x the
median), as a slow verifier or tool would. Steps per minute come from the trainer's own
step timestamps in ``metrics.jsonl``, after a warm-up step.

    python bench/async_vs_sync.py       # final line: {"ratio": async / sync steps per minute, ...}
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run(out: Path, async_level: int, steps: int, latency: float) -> tuple[float, int, float]:
    """Steps per minute of one run (between the first and the last step), samples dropped
    as stale, and the mean staleness of the samples trained on."""
    cmd = [sys.executable, "-m", "primerl.cli", "run", "--model", "glm5", "--env", "reverse-text",
           "--output-dir", str(out), "--max-steps", str(steps + 1), "--sft.steps", "0",
           "--orchestrator.async_level", str(async_level), "--orchestrator.max_off_policy_steps", "4",
           "--orchestrator.max_concurrent", "256", "--env.latency_s", str(latency), "--env.latency_tail", "20"]
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
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.time()
        sync, sync_dropped, _ = run(Path(tmp) / "sync", 0, args.steps, args.latency)
        asyn, async_dropped, async_staleness = run(Path(tmp) / "async", args.async_level, args.steps, args.latency)
        print(f"sync (async_level 0): {sync:.1f} steps/min; async (async_level {args.async_level}): "
              f"{asyn:.1f} steps/min; {time.time() - t0:.0f}s in all")
    print(json.dumps({"bench": "async_vs_sync", "steps": args.steps, "latency_median_s": args.latency,
                      "sync_steps_per_min": round(sync, 2), "async_steps_per_min": round(asyn, 2),
                      "async_level": args.async_level, "async_dropped_stale": async_dropped,
                      "async_mean_staleness": round(async_staleness, 2), "sync_dropped_stale": sync_dropped,
                      "ratio": round(asyn / sync, 2)}))


if __name__ == "__main__":
    main()
