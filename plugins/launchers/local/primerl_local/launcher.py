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
--inference.port P`` on its own port: ``inference.port + i`` when free, else a free one.
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
(:class:`primerl.kv_stores.KVStoreCapabilities`), starts before the servers and stops
after them: Mooncake's master for ``mooncake``; for ``disk`` under prefill/decode, one block
directory for every server, the run's ``kv/``, through which prefill servers hand prompts'
KV to decode servers. The options it sets (the master's address, the folder) go into the
run-time record too, and every server's store gets them.

No orphans, whatever happens: each child runs in its own process group (so its own
children go with it) and asks the kernel to SIGTERM it if the launcher dies. On Ctrl-C,
SIGTERM or a crashing child we stop all children — SIGTERM, then SIGKILL after a grace
period — and say why.

Stalls: a run that makes no progress for ``watchdog.stall_timeout_s`` is reported by the
:class:`primerl.watchdog.Watchdog` (every process's waits and stacks in
``logs/watchdog.log``, the stuck stage in one line) and, with ``watchdog.on_stall =
"exit"``, stopped with exit code 3.

CPU threads: the processes share the machine, so each child gets a share of the cores
(``OMP_NUM_THREADS``), which the trainer's ranks and the inference replicas split among
themselves; oversubscribed OpenMP threads spin and can make torch tens of times slower.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from primerl.children import own_group_and_die_with_parent
from primerl.config import RunConfig, dump_toml, to_dict
from primerl.errors import PrimerlError
from primerl.launchers import pick_ports
from primerl.resume import prepare_run
from primerl.rundir import RunDir
from primerl.runtime import RunTime
from primerl.runview import summarize
from primerl.watchdog import Watchdog, clear_beacons

CHILDREN = ("inference", "orchestrator", "trainer")  # kinds of child; inference may be N replicas
GRACE_SECONDS = 10.0
STALLED = 3  # the exit code of a run the watchdog stopped


def inference_names(cfg: RunConfig) -> list[str]:
    """The inference children's names (and log names): ``inference``, or ``inference-<i>``
    for each of ``inference.replicas`` > 1; with prefill/decode, ``inference-prefill-<i>``
    then ``inference-decode-<j>``."""
    inf = cfg.inference
    if inf.disaggregated():
        return ([f"inference-prefill-{i}" for i in range(inf.prefill_replicas)]
                + [f"inference-decode-{j}" for j in range(inf.decode_replicas)])
    n = inf.replicas
    return ["inference"] if n == 1 else [f"inference-{i}" for i in range(n)]


def inference_roles(cfg: RunConfig) -> list[str | None]:
    """Each inference child's ``--inference.role`` (None: a whole-request server), in
    :func:`inference_names`' order."""
    inf = cfg.inference
    if inf.disaggregated():
        return ["prefill"] * inf.prefill_replicas + ["decode"] * inf.decode_replicas
    return [None] * len(inference_names(cfg))


def run_time(cfg: RunConfig, ports: list[int], kv_store_options: dict[str, Any]) -> RunTime:
    """What this launch discovered: the servers' URLs (with prefill/decode, each pool's) and
    the KV store service's options."""
    urls = tuple(f"http://{cfg.inference.host}:{p}" for p in ports)
    n = cfg.inference.prefill_replicas if cfg.inference.disaggregated() else 0
    return RunTime(inference_urls=urls, prefill_urls=urls[:n], decode_urls=urls[n:] if n else (),
                   kv_store_options=kv_store_options)


def child_command(name: str, cfg: RunConfig, run_dir: RunDir, port: int | None = None,
                  role: str | None = None) -> list[str]:
    """``primerl <name> @ config.toml`` (an inference replica: ``--inference.port port`` after
    it, and ``--inference.role role`` for a prefill or decode server); a trainer of
    ``trainer.nproc`` > 1 ranks under torchrun (standalone: one node, its own rendezvous on a
    free port)."""
    cmd = ["-m", "primerl.cli", name, "@", str(run_dir.config)]
    if port is not None:
        cmd += ["--inference.port", str(port)]
    if role is not None:
        cmd += ["--inference.role", role]
    if name == "trainer" and cfg.trainer.nproc > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={cfg.trainer.nproc}", *cmd]
    return [sys.executable, *cmd]


def start_run_service(cfg: RunConfig, run_dir: RunDir) -> Any:
    """What the run's KV store needs set up once before its servers start (its declared
    ``run_service``: Mooncake's master, the disk store's shared folder under prefill/decode),
    started; the caller puts its options in the run-time record and stops it. None when the
    store declares none or the run needs none."""
    from primerl.registry import get_registry, load_target

    target = get_registry().capabilities("kv_store", cfg.inference.kv_store).run_service
    service = load_target(target)(cfg, run_dir) if target else None
    if service is not None:
        said = service.describe()
        if said:
            print(said, flush=True)
    return service


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


class Interrupted(Exception):
    pass


class LocalLauncher:
    """Runs a whole RL job on this machine."""

    def launch(self, cfg: RunConfig) -> int:
        run_dir = RunDir(Path(cfg.output_dir).resolve())
        out = run_dir.root
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
        ports = pick_ports(cfg.inference.host, cfg.inference.port, len(names))
        cfg.output_dir = str(out)
        run_dir.config.write_text(dump_toml(to_dict(cfg)))

        procs: dict[str, subprocess.Popen] = {}
        threads = os.environ.get("PRIMERL_THREADS") or str(max(1, (os.cpu_count() or 2) // 2))
        env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, **os.environ, "PYTHONUNBUFFERED": "1"}

        def on_signal(signum, _frame):
            raise Interrupted(signal.Signals(signum).name)

        old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        from primerl.runview import LiveView

        view = LiveView(cfg, run_dir)
        service = None
        try:
            service = start_run_service(cfg, run_dir)
            run_time(cfg, ports, service.options() if service is not None else {}).write(run_dir)
            children = [(name, "inference", port, role)
                        for name, port, role in zip(names, ports, inference_roles(cfg))]
            children += [(kind, kind, None, None) for kind in CHILDREN if kind != "inference"]
            spec = {name: (kind, port, role) for name, kind, port, role in children}

            def start(name: str, mode: str = "w") -> None:
                kind, port, role = spec[name]
                log = open(run_dir.log(name), mode)  # noqa: SIM115 - the child keeps it as its stdout
                procs[name] = subprocess.Popen(
                    child_command(kind, cfg, run_dir, port, role), stdout=log, stderr=subprocess.STDOUT,
                    env=child_env(kind, cfg, env), preexec_fn=own_group_and_die_with_parent,
                    cwd=os.getcwd(),
                )

            clear_beacons(run_dir)
            for name in spec:
                start(name)
            by_port = {f"inference:{port}": name for name, port in zip(names, ports)}
            dog = Watchdog(cfg, run_dir, names=lambda role: by_port.get(role, role.split("-")[0]),
                           logs=run_dir.log, urls=lambda: [f"http://{cfg.inference.host}:{p}" for p in ports])
            gone: list[str] = []  # inference replicas that exited for good, in the order seen
            restarts = dict.fromkeys(names, 0)
            with view:
                while True:
                    view.refresh()
                    if procs["trainer"].poll() == 0:
                        break
                    if (stall := dog.check()) is not None:
                        line = (f"the run made no progress for {cfg.watchdog.stall_timeout_s:.0f} s: {stall.stage} "
                                f"(every process's waits and stacks: {stall.report})")
                        if cfg.watchdog.on_stall == "exit":
                            view.stop()
                            self._stop_all(procs)
                            print(f"\nerror: {line}; stopped the run (watchdog.on_stall = \"exit\"; the same "
                                  f"command resumes it from its newest checkpoint)", file=sys.stderr)
                            return STALLED
                        view.note(f"warning: {line}; still waiting (watchdog.on_stall = \"wait\")")
                    for name in names:
                        if name in gone or procs[name].poll() is None:
                            continue
                        rc = procs[name].returncode
                        serving = sum(procs[n].poll() is None for n in names)
                        if serving and restarts[name] < cfg.inference.max_restarts:
                            restarts[name] += 1
                            view.note(f"warning: the {name} process exited with code {rc}; restarting it "
                                      f"({restarts[name]} of at most {cfg.inference.max_restarts}), {serving} of "
                                      f"{len(names)} inference servers serve meanwhile (log: {run_dir.log(name)})")
                            start(name, "a")
                            continue
                        gone.append(name)
                        if len(gone) < len(names):
                            view.note(f"warning: the {name} process exited with code {rc}; "
                                      f"{len(names) - len(gone)} of {len(names)} inference servers left, the "
                                      f"run goes on (log: {run_dir.log(name)})")
                    failed = [(n, p.returncode) for n, p in procs.items()
                              if n not in names and p.poll() not in (None, 0)]
                    if len(gone) == len(names) or failed:
                        if len(gone) == len(names):  # no server left (the only one, with one replica)
                            name, rc = gone[-1], procs[gone[-1]].returncode
                            what = f"the {name} process exited with code {rc}" if len(names) == 1 else (
                                f"every inference process exited (the last, {name}, with code {rc})")
                        else:
                            name, rc = failed[0]
                            what = f"the {name} process exited with code {rc}"
                        view.stop()
                        self._stop_all(procs)
                        print(f"\nerror: {what}; stopped the others.", file=sys.stderr)
                        print(_tail(run_dir.log(name)), file=sys.stderr)
                        print(f"Full log: {run_dir.log(name)}", file=sys.stderr)
                        return 1
                    time.sleep(0.5)
            view.refresh()
        except Interrupted as exc:
            view.stop()
            print(f"\n{exc.args[0]}: stopping inference, orchestrator and trainer...", file=sys.stderr)
            self._stop_all(procs)
            print(f"stopped; everything written so far is in {out}", file=sys.stderr)
            return 130
        finally:
            self._stop_all(procs)
            if service is not None:
                service.stop()
            for s, h in old.items():
                signal.signal(s, h)
        summarize(run_dir)
        return 0

    @staticmethod
    def _stop_all(procs: dict[str, subprocess.Popen]) -> None:
        live = {n: p for n, p in procs.items() if p.poll() is None}
        for p in live.values():
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + GRACE_SECONDS
        for p in live.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in live.values():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()



def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
