"""Prefix-aware routing vs a session-blind balancer: prefix-cache hit rate over replicas.

Four ``primerl inference`` servers (the tiny GLM-5 preset, embedded engine, 12 KV slots
each: room for a server's share of the episodes in flight, not for all of them) serve the
same multi-turn workload through each router in turn, the way the orchestrator sends it:
24 groups of 4 episodes, 8 groups in flight; an episode's prompt is a system prompt
common to all (16 tokens) and its group's task (48); each of its 8 turns resends the
growing conversation as token ids (``/v1/completions``, 16 sampled tokens), then the env
appends 32 tokens after a short pause. Routers:

* ``round-robin (session-blind)``: the round-robin plugin given no session, as any
  balancer that does not know which requests belong together: the baseline;
* ``round-robin``: the same plugin with each episode's session (``group-G-I``, as the
  orchestrator names them);
* ``sticky``: sessions stay, new sessions go to the least loaded server;
* ``vllm-router ...``: the vllm-router process in front of the servers, policies
  ``cache_aware`` (default flags, and with ``--balance-abs-threshold 4
  --balance-rel-threshold 1.2``), ``consistent_hash`` and ``sticky_least_loaded``;
  requests carry ``X-Session-ID`` (the router's ``headers``), as the orchestrator's client
  would send it.

Each router gets fresh prompts (its own seed), so nothing is served from an earlier
router's prefixes. The servers' ``/metrics`` counters give the hit rate:

    hit_rate = sum of primerl_prefix_cache_hit_tokens_total / sum of primerl_prompt_tokens_total
    hit_rate_ratio = best prefix-aware router's hit_rate / session-blind round-robin's

``max_share`` (the busiest server's share of requests; 1 / servers is even) shows what a
router paid in balance for its hits, ``seconds`` the wall time of the workload. The JSON
line also carries ``restore_vs_recompute``: ``measure_restore_vs_recompute(store)`` from
``bench/kv_restore.py`` (the KV-store benchmark) for the ``disk`` and ``mooncake`` stores
when that file exists, else null with the reason.

    python bench/prefix_routing.py              # final line: {"hit_rate_ratio": ..., "hit_rate": {...}, ...}
    python bench/prefix_routing.py --servers 2 --kv-slots 8 --routers sticky,round-robin
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODEL = "glm5"
BASELINE = "round-robin (session-blind)"
# (label, router plugin, constructor keywords, whether requests carry their session)
ROUTERS: list[tuple[str, str, dict[str, Any], bool]] = [
    (BASELINE, "round-robin", {}, False),
    ("round-robin", "round-robin", {}, True),
    ("sticky", "sticky", {}, True),
    ("vllm-router cache_aware", "vllm-router", {"policy": "cache_aware"}, True),
    ("vllm-router consistent_hash", "vllm-router", {"policy": "consistent_hash"}, True),
    ("vllm-router cache_aware balance 4", "vllm-router",
     {"policy": "cache_aware", "args": ["--balance-abs-threshold", "4", "--balance-rel-threshold", "1.2"]}, True),
    ("vllm-router sticky_least_loaded", "vllm-router", {"policy": "sticky_least_loaded"}, True),
]
COUNTERS = ("primerl_prompt_tokens_total", "primerl_prefix_cache_hit_tokens_total", "primerl_requests_total")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- servers ----------------------------------------------------------------------------------
def start_servers(n: int, args: argparse.Namespace, work: Path) -> list[tuple[subprocess.Popen, str, Path]]:
    threads = max(1, (os.cpu_count() or 1) // n)
    out = []
    for i in range(n):
        port, log = free_port(), work / f"server{i}.log"
        cmd = [sys.executable, "-m", "primerl.cli", "inference", "--model", MODEL, "--host", "127.0.0.1",
               "--port", str(port), "--inference.max_model_len", str(args.max_model_len),
               "--inference.kv_slots", str(args.kv_slots), "--inference.max_batch_size", str(args.kv_slots)]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        with open(log, "w") as out_file:  # the child keeps its own descriptor
            proc = subprocess.Popen(cmd, stdout=out_file, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        out.append((proc, f"http://127.0.0.1:{port}", log))
    return out


def wait_ready(servers: list[tuple[subprocess.Popen, str, Path]], timeout: float = 300) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    for proc, url, log in servers:
        while True:
            if proc.poll() is not None:
                sys.exit(f"error: the server on {url} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                sys.exit(f"error: no answer from {url} in {timeout:.0f}s:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)


def stop_servers(servers: list[tuple[subprocess.Popen, str, Path]]) -> None:
    for proc, _, _ in servers:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc, _, _ in servers:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def counters(urls: list[str]) -> dict[str, dict[str, float]]:
    import httpx

    out = {}
    for url in urls:
        values = {}
        for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
            name, _, value = line.partition(" ")
            if name in COUNTERS:
                values[name] = float(value)
        out[url] = values
    return out


# ---- the workload -----------------------------------------------------------------------------
def groups(args: argparse.Namespace, seed: int) -> list[list[int]]:
    """Each group's shared prompt: the common system prompt, then the group's task."""
    system = random.Random(args.seed).choices(range(32, 250), k=args.system_tokens)
    rng = random.Random(seed)
    return [system + rng.choices(range(32, 250), k=args.task_tokens) for _ in range(args.groups)]


async def run_router(router: Any, with_session: bool, prompts: list[list[int]], args: argparse.Namespace,
                     seed: int) -> int:
    """Every group's episodes through ``router``, as the orchestrator's client sends them
    (route, POST, finished); returns the requests sent."""
    import httpx

    from primerl.routers import Route

    headers_of = getattr(router, "headers", None)
    sent = 0
    gate = asyncio.Semaphore(args.concurrent_groups)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=256)) as http:

        async def complete(ids: list[int], session: str) -> list[int]:
            nonlocal sent
            route = Route(path="/v1/completions", session=session if with_session else None, prompt_tokens=len(ids))
            url = router.route(route)
            headers = dict(headers_of(route)) if headers_of is not None else {}
            t0, ok = time.monotonic(), False
            try:
                r = await http.post(url + "/v1/completions", headers=headers, json={
                    "model": MODEL, "prompt": ids, "max_tokens": args.output_tokens, "temperature": 1.0,
                    "ignore_eos": True})
                ok = r.status_code == 200
            finally:
                router.finished(route, url, ok=ok, seconds=time.monotonic() - t0)
            if not ok:
                raise RuntimeError(f"request to {url} failed ({r.status_code}): {r.text[:300]}")
            sent += 1
            return r.json()["choices"][0]["token_ids"]

        async def episode(g: int, i: int) -> None:
            rng = random.Random(seed * 1_000_003 + g * 1009 + i)
            ids = list(prompts[g])
            for _ in range(args.turns):
                ids = ids + await complete(ids, f"group-{g}-{i}")
                ids = ids + rng.choices(range(32, 250), k=args.env_tokens)  # the env's turn
                await asyncio.sleep(rng.uniform(0, args.env_ms) / 1000)

        async def group(g: int) -> None:
            async with gate:
                await asyncio.gather(*(episode(g, i) for i in range(args.group_size)))

        await asyncio.gather(*(group(g) for g in range(len(prompts))))
    return sent


def measure(label: str, plugin: str, kwargs: dict[str, Any], with_session: bool, urls: list[str],
            args: argparse.Namespace, seed: int) -> dict[str, Any]:
    from primerl.registry import get_registry

    router = get_registry().load("router", plugin)(**kwargs)
    prompts = groups(args, seed)
    router.start(urls)
    try:
        before = counters(urls)
        t0 = time.perf_counter()
        sent = asyncio.run(run_router(router, with_session, prompts, args, seed))
        seconds = time.perf_counter() - t0
        after = counters(urls)
    finally:
        router.close()
    delta = {u: {k: after[u].get(k, 0.0) - before[u].get(k, 0.0) for k in COUNTERS} for u in urls}
    prompt = sum(d["primerl_prompt_tokens_total"] for d in delta.values())
    hits = sum(d["primerl_prefix_cache_hit_tokens_total"] for d in delta.values())
    per_server = [int(d["primerl_requests_total"]) for d in delta.values()]
    return {"hit_rate": hits / prompt if prompt else 0.0, "requests": sent, "per_server": per_server,
            "max_share": max(per_server) / max(1, sum(per_server)), "seconds": seconds,
            "per_server_hit_rate": [d["primerl_prefix_cache_hit_tokens_total"] / d["primerl_prompt_tokens_total"]
                                    if d["primerl_prompt_tokens_total"] else None for d in delta.values()]}


# ---- the KV-store hook ------------------------------------------------------------------------
def restore_vs_recompute() -> tuple[dict[str, float | None] | None, str | None]:
    """``measure_restore_vs_recompute(store)`` from bench/kv_restore.py for each of its
    ``STORES`` (``disk``, ``mooncake``); (None, why) when that benchmark is not there."""
    path = Path(__file__).with_name("kv_restore.py")
    if not path.exists():
        return None, "bench/kv_restore.py does not exist yet (the KV-store benchmark provides measure_restore_vs_recompute)"
    spec = importlib.util.spec_from_file_location("kv_restore", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - reported in the JSON line, the routing figures stand
        return None, f"bench/kv_restore.py failed to import: {type(exc).__name__}: {exc}"
    fn = getattr(module, "measure_restore_vs_recompute", None)
    if fn is None:
        return None, "bench/kv_restore.py has no measure_restore_vs_recompute(store)"
    figures: dict[str, float | None] = {}
    reasons = []
    for store in getattr(module, "STORES", ("disk", "mooncake")):
        try:
            figures[store] = float(fn(store))
        except Exception as exc:  # noqa: BLE001 - one store's failure leaves the other's figure
            figures[store] = None
            reasons.append(f"{store}: {type(exc).__name__}: {exc}")
    return figures, "; ".join(reasons) or None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--servers", type=int, default=4, help="inference servers (2-4)")
    ap.add_argument("--kv-slots", type=int, default=12, help="KV slots per server (also its max batch size)")
    ap.add_argument("--groups", type=int, default=24)
    ap.add_argument("--group-size", type=int, default=4, help="episodes per group, sharing its prompt")
    ap.add_argument("--concurrent-groups", type=int, default=8)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--system-tokens", type=int, default=16, help="prompt prefix shared by every group")
    ap.add_argument("--task-tokens", type=int, default=48, help="prompt tokens shared by one group's episodes")
    ap.add_argument("--output-tokens", type=int, default=16, help="tokens generated each turn")
    ap.add_argument("--env-tokens", type=int, default=32, help="env tokens appended after each turn")
    ap.add_argument("--env-ms", type=float, default=20.0, help="env step time, uniform in [0, this]")
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--routers", default="", help="comma-separated labels to run (default: all)")
    ap.add_argument("--no-restore", action="store_true", help="skip the restore_vs_recompute hook")
    args = ap.parse_args()
    longest = args.system_tokens + args.task_tokens + args.turns * (args.output_tokens + args.env_tokens)
    if longest > args.max_model_len:
        sys.exit(f"error: an episode reaches {longest} tokens, over --max-model-len {args.max_model_len}")

    from primerl.registry import get_registry

    chosen = [r for r in ROUTERS if not args.routers or r[0] in args.routers.split(",")]
    installed = {name for name in ("round-robin", "sticky", "vllm-router") if _has_router(get_registry(), name)}
    work = Path(tempfile.mkdtemp(prefix="bench-prefix-routing-"))
    servers = start_servers(args.servers, args, work)
    results: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    try:
        wait_ready(servers)
        urls = [url for _, url, _ in servers]
        print(f"{len(urls)} servers up ({args.kv_slots} KV slots each); {args.groups} groups x {args.group_size} "
              f"episodes x {args.turns} turns per router", flush=True)
        for k, (label, plugin, kwargs, with_session) in enumerate(chosen):
            if plugin not in installed:
                skipped[label] = f"router plugin '{plugin}' is not installed"
                print(f"{label}: skipped ({skipped[label]})", flush=True)
                continue
            try:
                res = measure(label, plugin, kwargs, with_session, urls, args, args.seed * 100 + k + 1)
            except Exception as exc:  # noqa: BLE001 - a router that cannot start (no binary) is reported, the rest run
                skipped[label] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
                print(f"{label}: failed ({skipped[label]})", flush=True)
                continue
            results[label] = res
            print(f"{label}: hit rate {res['hit_rate']:.3f}, requests per server {res['per_server']}, "
                  f"{res['seconds']:.1f}s", flush=True)
    finally:
        stop_servers(servers)

    restore, restore_reason = (None, "skipped (--no-restore)") if args.no_restore else restore_vs_recompute()
    base = results.get(BASELINE, {}).get("hit_rate")
    aware = {k: v["hit_rate"] for k, v in results.items() if k != BASELINE}
    best = max(aware, key=aware.get) if aware else None
    print(json.dumps({
        "bench": "prefix_routing", "model": f"{MODEL} tiny", "servers": args.servers, "kv_slots": args.kv_slots,
        "workload": {"groups": args.groups, "group_size": args.group_size, "turns": args.turns,
                     "concurrent_groups": args.concurrent_groups, "system_tokens": args.system_tokens,
                     "task_tokens": args.task_tokens, "output_tokens": args.output_tokens,
                     "env_tokens": args.env_tokens},
        "hit_rate": {k: round(v["hit_rate"], 3) for k, v in results.items()},
        "max_share": {k: round(v["max_share"], 3) for k, v in results.items()},
        "seconds": {k: round(v["seconds"], 1) for k, v in results.items()},
        "ratio_to_blind": {k: round(v["hit_rate"] / base, 2) for k, v in results.items()} if base else None,
        "best": best,
        "hit_rate_ratio": round(aware[best] / base, 2) if best and base else None,
        "skipped": skipped or None,
        "restore_vs_recompute": restore, "restore_vs_recompute_reason": restore_reason,
    }))


def _has_router(registry: Any, name: str) -> bool:
    try:
        registry.load("router", name)
    except Exception:  # noqa: BLE001 - not installed, or broken: skipped with the reason
        return False
    return True


if __name__ == "__main__":
    main()
