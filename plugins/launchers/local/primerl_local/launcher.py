"""The local launcher: one machine, three kinds of process, a live view, a clean exit.

``primerl run`` resolves the config, writes it to ``OUTPUT_DIR/config.toml`` and hands
it here. We start ``primerl inference``, ``primerl orchestrator`` and ``primerl trainer``
as separate processes (each reads that file), send each one's output to
``OUTPUT_DIR/logs/<name>.log``, and follow ``OUTPUT_DIR/metrics.jsonl`` to draw a live
view. The run ends when the trainer finishes its last step. Before anything starts,
:func:`primerl.resume.prepare_run` decides whether the directory's run continues (the same
command again resumes an unfinished run from its newest usable checkpoint), starts over, or
is refused (a finished run, another config).

Replicas: ``inference.replicas`` N > 1 starts N inference servers, ``inference-<i>``
(logs ``logs/inference-<i>.log``), each ``primerl inference @ config.toml
--inference.port P`` on its own port: ``inference.port + i`` when free, else a free one. The
launcher binds each server's port before anything starts and holds it for the whole run,
handing the socket to each start of the server (``--inference.listen_fd``): two runs on one
machine never pick the same port, and a restarting server finds its port still there.
The URLs of the ports picked go into the run-time record (``OUT/runtime.json``,
:mod:`primerl.runtime`), which is where the orchestrator and the trainer find the servers. The orchestrator survives a server that
dies (its requests are re-sent to the others), so one inference process exiting is shown
and the run goes on: the launcher starts it again on its port, up to
``inference.max_restarts`` times per server, and the orchestrator readmits it with the
current weights once its ``/health`` answers. A server that exits with no other one up is
not restarted: when every one has exited (or the only one, with N = 1), the launcher stops
the run.

Prefill/decode: ``inference.prefill_replicas`` P and ``decode_replicas`` D (both set) start
P servers ``inference-prefill-<i>`` and D servers ``inference-decode-<j>`` instead, each with
``--inference.role`` after its port; the run-time record lists each pool's URLs.

The KV store's run service, when it declares one
(:class:`primerl.kv_stores.KVStoreCapabilities`; started by :mod:`primerl.kv_service` on this
machine), starts before the servers and stops
after them: Mooncake's master for ``mooncake``; for ``disk`` under prefill/decode, one block
directory for every server, the run's ``kv/``, through which prefill servers hand prompts'
KV to decode servers. The options it sets (the master's address, the folder) go into the
run-time record too, and every server's store gets them.

Following them is the one supervisor's (:class:`primerl.supervisor.Supervisor`, which the
Slurm job runs too): restarts, stalls (``logs/watchdog.log``, exit code 3), a failing child,
Ctrl-C or SIGTERM (every child stopped: SIGTERM, then SIGKILL after a grace period; each in
its own process group, dying with the launcher: no orphans). This module places the
children, shows the live view while they run, and says how the run ended.

CPU threads: the processes share the machine, so each child gets a share of the cores
(``OMP_NUM_THREADS``), which the trainer's ranks and the inference replicas split among
themselves; oversubscribed OpenMP threads spin and can make torch tens of times slower.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from primerl.config import RunConfig, dump_toml, to_dict
from primerl.errors import PrimerlError
from primerl.inference import server_url
from primerl.kv_service import start_run_service
from primerl.kv_stores import ServiceSite
from primerl.launchers import HeldPort, LauncherConfig, hold_ports, inference_names, inference_roles, process_command
from primerl.resume import prepare_run
from primerl.rundir import RunDir
from primerl.runtime import RunTime
from primerl.runview import LiveView, summarize
from primerl.supervisor import Child, Duty, Outcome, Supervisor, tail

CHILDREN = ("inference", "orchestrator", "trainer")  # kinds of child; inference may be N replicas
DUTIES = {"inference": Duty.SERVES, "orchestrator": Duty.WORKS, "trainer": Duty.FINISHES}


def run_time(cfg: RunConfig, ports: list[int], kv_store_options: dict[str, Any]) -> RunTime:
    """What this launch discovered: the servers' URLs (with prefill/decode, each pool's) and
    the KV store service's options."""
    urls = tuple(server_url(cfg.inference.host, p) for p in ports)
    n = cfg.inference.prefill_replicas if cfg.inference.disaggregated() else 0
    return RunTime(inference_urls=urls, prefill_urls=urls[:n], decode_urls=urls[n:] if n else (),
                   kv_store_options=kv_store_options)


def child_command(name: str, cfg: RunConfig, run_dir: RunDir, port: int | None = None,
                  role: str | None = None) -> list[str]:
    """``primerl <name> @ config.toml`` (an inference replica: ``--inference.port port`` after
    it, and ``--inference.role role`` for a prefill or decode server); a trainer of
    ``trainer.nproc`` > 1 ranks under torchrun (standalone: one node, its own rendezvous on a
    free port)."""
    cmd = process_command(name, run_dir.config, port=port, role=role)
    if name == "trainer" and cfg.trainer.nproc > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={cfg.trainer.nproc}", *cmd[1:]]
    return cmd


def child_env(name: str, cfg: RunConfig, env: dict[str, str]) -> dict[str, str]:
    """The trainer's ranks share its share of the cores (``trainer.threads`` when set); so
    do the inference servers. A trainer given more than its share overlaps the others'
    cores, so every child's idle OpenMP threads then sleep rather than spin (spinning
    threads of one process take the core another needs)."""
    if cfg.trainer.threads and "OMP_WAIT_POLICY" not in os.environ:
        env = {**env, "OMP_WAIT_POLICY": "PASSIVE"}
    total = cfg.trainer.threads if name == "trainer" and cfg.trainer.threads else int(env["OMP_NUM_THREADS"])
    split = {"trainer": cfg.trainer.nproc, "inference": len(inference_names(cfg))}.get(name, 1)
    if split == 1 and total == int(env["OMP_NUM_THREADS"]):
        return env
    threads = str(max(1, total // split))
    return {**env, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}


def children(cfg: RunConfig, run_dir: RunDir, held: list[HeldPort]) -> list[Child]:
    """The run's processes on this machine: the inference servers (each handed the socket of
    the port held for it), the orchestrator and the trainer, each with its share of the cores."""
    threads = os.environ.get("PRIMERL_THREADS") or str(max(1, (os.cpu_count() or 2) // 2))
    env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, **os.environ, "PYTHONUNBUFFERED": "1"}
    placed: list[tuple[str, str, HeldPort | None, str | None]] = [
        (name, "inference", port, role) for name, port, role in zip(inference_names(cfg), held, inference_roles(cfg))]
    placed += [(kind, kind, None, None) for kind in CHILDREN if kind != "inference"]
    return [Child(name=name, duty=DUTIES[kind], log=run_dir.log(name), env=child_env(kind, cfg, env), held=port,
                  command=tuple(child_command(kind, cfg, run_dir, port.port if port else None, role)),
                  beacon=f"inference:{port.port}" if port else kind)
            for name, kind, port, role in placed]


class _View:
    """The supervisor's reporter: the live view, and what ending means on this terminal."""

    def __init__(self, view: LiveView) -> None:
        self.view = view

    def tick(self) -> None:
        self.view.refresh()

    def note(self, line: str) -> None:
        self.view.note(line)

    def stopping(self, outcome: Outcome) -> None:
        self.view.stop()
        if outcome.signal:
            print(f"\n{outcome.signal}: stopping inference, orchestrator and trainer...", file=sys.stderr)


class LocalLauncher:
    """Runs a whole RL job on this machine."""

    Config = LauncherConfig  # no keys of its own

    def launch(self, cfg: RunConfig) -> int:
        run_dir = RunDir(Path(cfg.output_dir).resolve())
        # a finished run or another config is refused; an unfinished run continues from its
        # newest usable checkpoint, what came after it set aside (primerl.resume)
        for note in prepare_run(cfg).notes:
            print(note, flush=True)
        run_dir.logs.mkdir(parents=True, exist_ok=True)
        names = inference_names(cfg)
        fixed = cfg.inference.fixed_ports()
        if len(names) > 1 and fixed:
            key, port = next(iter(fixed.items()))
            raise PrimerlError(f"{key} ({port}) fixes a port of each inference server, which {len(names)} servers on "
                               f"this machine cannot share: leave it 0 (a free port each)")
        try:
            held = hold_ports(cfg.inference.host, cfg.inference.port, len(names))
        except OSError as exc:
            raise PrimerlError(f"inference.host {cfg.inference.host!r}: no port can be bound there ({exc}); "
                               f"give an address of this machine (127.0.0.1)") from None
        ports = [h.port for h in held]
        cfg.output_dir = str(run_dir.root)
        run_dir.config.write_text(dump_toml(to_dict(cfg)))
        service = None
        try:
            service = start_run_service(cfg, ServiceSite(run_dir=run_dir))  # what the KV store declares
            run_time(cfg, ports, service.options() if service is not None else {}).write(run_dir)
            view = LiveView(cfg, run_dir)
            supervisor = Supervisor(cfg, run_dir, children(cfg, run_dir, held), _View(view),
                                    urls=lambda: [server_url(cfg.inference.host, p) for p in ports])
            with view:
                outcome = supervisor.run()
                view.refresh()
        finally:
            if service is not None:
                service.stop()
            for h in held:
                h.close()
        return self._report(cfg, run_dir, outcome)

    @staticmethod
    def _report(cfg: RunConfig, run_dir: RunDir, outcome: Outcome) -> int:
        if outcome.code == 0:
            summarize(run_dir)
        elif outcome.signal:
            print(f"stopped; everything written so far is in {run_dir.root}", file=sys.stderr)
            return 130
        elif outcome.stalled:
            print(f"\nerror: {outcome.message}; stopped the run (watchdog.on_stall = \"exit\"; the same command "
                  f"resumes it from its newest checkpoint)", file=sys.stderr)
        else:
            print(f"\nerror: {outcome.message}; stopped the others.", file=sys.stderr)
            print(tail(outcome.log), file=sys.stderr)
            print(f"Full log: {outcome.log}", file=sys.stderr)
            return 1
        return outcome.code
