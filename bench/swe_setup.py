"""What a swe task's own environment costs: its first episode against the later ones.

    python bench/swe_setup.py [--set pyutils|layouts|all] [--tasks N] [--episodes K]

For each of N tasks of the shipped set(s), in a fresh cache: the first episode's
``Swe.setup`` (checkout, the task's environment made — venv, the recipe's editable install in
the sandbox — and the setup check's collection run), then K more episodes' ``setup`` (the
environment and the check come from the cache: a checkout only), and one ``reward`` (a test
run in the environment). A fresh ``Swe`` (as another env worker process would make it) times
one more episode to show the on-disk cache. Prints a table and a final JSON line with the
medians (seconds) and the ratio first / later.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))

from primerl_swe.build_tasks import shipped
from primerl_swe.env import Swe, SweConfig


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def bench(name: str, cache: Path, n: int, episodes: int) -> dict[str, list[float]]:
    tasks = shipped(name, cache / "tasks", log=lambda msg: None)
    cfg = SweConfig(tasks=str(tasks), cache_dir=str(cache))
    env = Swe(cfg)
    out: dict[str, list[float]] = {"first": [], "later": [], "other_process": [], "reward": [], "env_made": []}
    for task in list(env.tasks("train"))[:n]:
        state, first = _timed(lambda t=task: env.setup(t))
        out["first"].append(first)
        out["env_made"].append(_made_in(Path(state["env"])))  # of the first setup: making the environment
        reward, seconds = _timed(lambda t=task, s=state: env.reward(t, s))
        out["reward"].append(seconds)
        env.cleanup(task, state)
        for _ in range(episodes):
            state, later = _timed(lambda t=task: env.setup(t))
            out["later"].append(later)
            env.cleanup(task, state)
        other = Swe(cfg)
        state, seconds = _timed(lambda t=task, e=other: e.setup(t))
        out["other_process"].append(seconds)
        other.cleanup(task, state)
        print(f"{name:8s} {task.id:45s} first {first:6.2f}s  later {statistics.median(out['later'][-episodes:]):6.3f}s"
              f"  other process {seconds:6.3f}s  reward {out['reward'][-1]:5.2f}s ({reward})", flush=True)
    env.close()
    return out


def _made_in(root: Path) -> float:
    return float(json.loads((root / ".primerl-env.json").read_text())["setup_s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", choices=["pyutils", "layouts", "all"], default="all")
    ap.add_argument("--tasks", type=int, default=4, help="tasks per set")
    ap.add_argument("--episodes", type=int, default=3, help="later episodes per task")
    args = ap.parse_args()
    sets = ["pyutils", "layouts"] if args.set == "all" else [args.set]
    result: dict[str, object] = {"bench": "swe_setup", "tasks_per_set": args.tasks}
    with tempfile.TemporaryDirectory(prefix="primerl-swe-bench-") as tmp:
        for name in sets:
            t = bench(name, Path(tmp) / name, args.tasks, args.episodes)
            med = {k: round(statistics.median(v), 3) for k, v in t.items()}
            result[name] = {**med, "first_over_later": round(med["first"] / max(med["later"], 1e-9), 1)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
