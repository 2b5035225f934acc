"""``primerl eval``: a model's score on an environment's tasks, with nothing trained.

    primerl eval --model.checkpoint smollm2-135m-instruct --env reverse-text --tasks 200
    primerl eval --run outputs/run --env reverse-text --tasks 200          # the run's newest checkpoint

The model is a preset, a checkpoint folder, a GGUF file, a packaged checkpoint, or a run's
checkpoint (``--run OUT [--step N]``: the run's own config, its weights at step N). One
inference server of the run's backend is started on it (``primerl inference``, its log in a
scratch folder shown when it fails), or the servers of ``--inference.urls`` are used as they
are. Every task of the split runs ``--samples`` times through the env's own rollout kind
and is scored by :mod:`primerl.evaluation`, the same code as a run's ``eval/...`` metrics.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs

from primerl.config import RunConfig, dump_toml, to_dict
from primerl.errors import PrimerlError
from primerl.evaluation import TaskScore, score_tasks, summarize


@attrs.frozen
class EvalRequest:
    """What ``primerl eval`` was asked (beyond the run config)."""

    split: str = "eval"
    tasks: int = 200  # the split's first this many tasks
    samples: int = 1  # episodes per task
    temperature: float = 0.0
    pass_threshold: float = 1.0


def run_checkpoint(run_dir: str, step: int | None) -> tuple[Path, Path]:
    """A run's ``config.toml`` and the checkpoint folder of ``step`` (None: its newest)."""
    from primerl.rundir import RunDir, step_name

    run = RunDir(run_dir)
    if not run.config.is_file():
        raise PrimerlError(f"--run {run_dir}: no config.toml there; give the --output-dir of a primerl run")
    if step is None:
        found = run.latest_checkpoint()
        if found is None:
            raise PrimerlError(f"--run {run_dir} has no complete checkpoint yet (checkpoints/step_N); evaluate a "
                               f"model or checkpoint instead, or wait for the run's first checkpoint")
        step, folder = found
    else:
        folder = run.checkpoint(step)
        if not (folder / "config.json").is_file():
            have = sorted(p.name for p in run.root.glob("checkpoints/step_*"))
            raise PrimerlError(f"--run {run_dir} --step {step}: no checkpoint {step_name(step)} (the run keeps "
                               f"{', '.join(have) or 'none'}; trainer.keep_checkpoints sets how many)")
    if (folder / "adapter").is_dir():
        raise PrimerlError(f"{folder} holds LoRA adapters beside frozen weights: evaluate the run's published "
                           f"merged weights instead (--model.checkpoint {run.root}/weights/{step_name(step)}, kept "
                           f"while the run is recent), or load the adapter with PEFT and save the merged model")
    return run.config, folder


def scratch_config(cfg: RunConfig, scratch: Path) -> Path:
    """The config the eval's inference server reads (its output_dir the scratch folder)."""
    data = to_dict(cfg)
    data["output_dir"] = str(scratch)
    path = scratch / "config.toml"
    path.write_text(dump_toml(data))
    return path


class Server:
    """One ``primerl inference`` child for the evaluation, stopped (its process group) on exit."""

    def __init__(self, cfg: RunConfig, scratch: Path) -> None:
        from primerl.children import own_group_and_die_with_parent
        from primerl.inference import server_url
        from primerl.launchers import hold_ports

        # the port is bound from here on and the server handed its socket: no run on this
        # machine can take it while the server loads its model (and answer in its place)
        self.held = hold_ports(cfg.inference.host, cfg.inference.port, 1)[0]
        self.port = self.held.port
        self.url = server_url(cfg.inference.host, self.port)
        self.log = scratch / "inference.log"
        cmd = [sys.executable, "-m", "primerl.cli", "inference", "@", str(scratch_config(cfg, scratch)),
               "--inference.port", str(self.port), "--inference.listen_fd", str(self.held.fd)]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(os.cpu_count() or 1))}
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, pass_fds=(self.held.fd,),
                                         preexec_fn=own_group_and_die_with_parent)

    def failure(self) -> str | None:
        """Why the server is gone (its exit and log's last line), or None while it runs."""
        if self.proc.poll() is None:
            return None
        lines = [ln for ln in self.log.read_text(errors="replace").splitlines() if ln.strip()]
        return f"the inference server exited with code {self.proc.returncode}: {lines[-1] if lines else '(no output)'}"

    def stop(self) -> None:
        import signal

        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=15)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.held.close()


async def _wait_up(client: Any, server: Server | None, deadline_s: float = 900.0) -> None:
    """Until the servers answer ``/health``; a server that exits first is named with its cause."""
    waiting = asyncio.create_task(client.wait_ready(deadline_s))
    while not waiting.done():
        if server is not None and (why := server.failure()):
            waiting.cancel()
            raise PrimerlError(f"{why} (log: {server.log})")
        await asyncio.sleep(0.2)
    waiting.result()


def evaluate(cfg: RunConfig, request: EvalRequest, *, on_task: Callable[[TaskScore], None] | None = None,
             say: Callable[[str], None] = print) -> tuple[list[TaskScore], dict[str, Any]]:
    """Serve ``cfg``'s model (or use ``inference.urls``), score the split's first tasks; the
    scores in task order and their summary (:func:`primerl.evaluation.summarize`)."""
    from primerl.registry import get_registry

    env = get_registry().load("env", cfg.env.name)(cfg.env)
    try:
        tasks = list(itertools.islice(env.tasks(request.split), request.tasks))
    except ValueError as exc:
        raise PrimerlError(f"--split {request.split!r}: {exc}") from None
    if not tasks:
        raise PrimerlError(f"environment '{cfg.env.name}' has no {request.split!r} tasks")
    if len(tasks) < request.tasks:  # scored as asked would read as n tasks: say the split is smaller
        say(f"note: the {request.split} split of {cfg.env.name} has {len(tasks)} tasks, fewer than --tasks "
            f"{request.tasks}; all {len(tasks)} are scored (an env with num_eval sets its size: --env.num_eval)")
    scratch = Path(tempfile.mkdtemp(prefix="primerl-eval-"))
    server = None if cfg.inference.urls else Server(cfg, scratch)
    ok = False
    try:
        scores = asyncio.run(_score(cfg, env, tasks, request, server, on_task, say))
        ok = True
    finally:
        if server is not None:
            server.stop()
        env.close()
        if ok:
            shutil.rmtree(scratch, ignore_errors=True)
    return scores, summarize(scores, pass_threshold=request.pass_threshold)


async def _score(cfg: RunConfig, env: Any, tasks: list[Any], request: EvalRequest, server: Server | None,
                 on_task: Callable[[TaskScore], None] | None, say: Callable[[str], None]) -> list[TaskScore]:
    from primerl.envs.rollouts import rollout_kind
    from primerl.orchestrator.client import inference_client
    from primerl.registry import get_registry

    urls = [server.url] if server is not None else [u.rstrip("/") for u in cfg.inference.urls]
    client = inference_client(cfg, servers=urls, api_key=cfg.inference.resolved_api_key())
    scorer = ThreadPoolExecutor(max_workers=max(8, request.samples), thread_name_prefix="score")
    workers = None
    try:
        t0 = time.monotonic()
        await _wait_up(client, server)
        say(f"inference up after {time.monotonic() - t0:.1f} s ({', '.join(urls)}); scoring {len(tasks)} "
            f"{request.split} tasks x {request.samples} at temperature {request.temperature:g}")
        tokenizer = lambda: get_registry().load("model", cfg.model.name)().tokenizer(cfg.model)
        kind, workers = rollout_kind(cfg, env, cfg.env, client, tokenizer=tokenizer, scorer=scorer)
        scores = await score_tasks(kind, tasks, samples=request.samples, temperature=request.temperature)
        for s in scores:
            if on_task is not None:
                on_task(s)
        return scores
    finally:
        if workers is not None:
            workers.close()
        scorer.shutdown(wait=False, cancel_futures=True)
        await client.close()


def completion_text(score: TaskScore, tokenizer: Any) -> str | None:
    """The first episode's model tokens, decoded (what the model answered)."""
    if not score.samples:
        return None
    s = score.samples[0]
    return tokenizer.decode([t for t, m in zip(s.tokens, s.loss_mask) if m], skip_special_tokens=True)


def write_lines(path: str, scores: list[TaskScore], summary: dict[str, Any], threshold: float) -> None:
    """Per-task JSON lines and the summary line into ``path``."""
    with open(path, "w") as f:
        for s in scores:
            f.write(json.dumps(s.record(threshold)) + "\n")
        f.write(json.dumps(summary) + "\n")
