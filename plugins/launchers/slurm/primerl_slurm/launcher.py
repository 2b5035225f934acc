"""The slurm launcher: a whole run as one Slurm job, followed live, cancelled cleanly.

    primerl run --model glm5 --env swe --launcher slurm --launcher.nodes 28 [--dry-run]

``primerl run`` resolves the config and hands it here. We write ``OUT/config.toml`` and the
job (``OUT/slurm/primerl.sbatch`` plus one script per role, see ``scripts.py``), submit it
with ``sbatch`` (unless ``--dry-run`` / ``launcher.dry_run``: then we stop after writing),
follow it with ``squeue`` (``scontrol``/``sacct`` once it has left the queue), show the
local launcher's live view (``primerl.runview.LiveView``: it reads ``metrics.jsonl``,
which lands in the run directory wherever the trainer runs), and ``scancel`` the job on
Ctrl-C or SIGTERM. The run's exit code is the job's: 0 when the trainer finished its last
step; otherwise the failing role's code, and the cause from that role's log.

Why one job whose roles are ``srun`` steps, rather than a heterogeneous job or a job per
role chained with dependencies:

* every role must run at the same time and stop together. In one job the batch script
  follows its steps and stops all of them when one fails; ``scancel`` of one id stops
  everything; nothing is left queued when a role dies (dependent jobs would be);
* the addresses (inference URLs, the trainer's rendezvous, the Mooncake master) exist only
  once nodes are allocated. The batch script sees every node at once and writes them for
  the processes (the run-time record, ``OUT/runtime.json``) before starting any; separate jobs would
  have to find each other through files while queued at different times;
* one node is the same job: all roles on it as overlapping steps (``srun --overlap``).
  Components of a heterogeneous job are separate allocations, which cannot share a node.

What the roles need from the cluster: the run directory (``--output-dir``) and this Python
environment on a filesystem every node sees; the nodes reaching each other over TCP.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import attrs

from primerl.config import RunConfig, dump_toml, to_dict
from primerl.errors import PrimerlError
from primerl.resume import prepare_run
from primerl.rundir import RunDir
from primerl.runtime import read_runtime
from primerl.runview import summarize
from primerl.watchdog import Watchdog, clear_beacons
from primerl_slurm.config import SlurmConfig
from primerl_slurm.scripts import BATCH, layout, write_scripts

POLL_SLURM_SECONDS = 5.0  # squeue is asked this often (the view refreshes every 0.5 s)
GIVE_UP_SECONDS = 300.0  # Slurm unreachable this long: stop following (the job runs on)
CANCEL_WAIT_SECONDS = 90.0
STALLED = 3  # the exit code of a run the watchdog stopped
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL",
         "DEADLINE", "REVOKED", "SPECIAL_EXIT"}
INSTALL = ("install Slurm's client commands (Debian/Ubuntu: apt-get install slurm-client) or run on a login "
           "node; --dry-run writes the job scripts without them")


class Interrupted(Exception):
    pass


class SlurmLauncher:
    """Runs a whole RL job as one Slurm job."""

    Config = SlurmConfig

    def launch(self, cfg: RunConfig) -> int:
        lc = cfg.launcher
        if not isinstance(lc, SlurmConfig):  # constructed by hand, not through load_config
            raise PrimerlError("the slurm launcher needs its [launcher] keys: set launcher.name = 'slurm' in the config")
        run_dir = RunDir(Path(cfg.output_dir).resolve())
        out = run_dir.root
        # a finished run or another config is refused; an unfinished run continues from its
        # newest usable checkpoint (primerl.resume; the job runs it again when Slurm requeues)
        for note in prepare_run(cfg, dry_run=lc.dry_run).notes:
            print(note, flush=True)
        try:
            lay = layout(cfg)
        except ValueError as exc:
            raise PrimerlError(str(exc)) from None
        if not lay.shared and cfg.trainer.weight_channel == "shm":
            raise PrimerlError(
                "trainer.weight_channel = 'shm' hands weights over in /dev/shm, which only servers on the trainer's "
                "node can read, and launcher.nodes > 1 puts them on nodes of their own: use 'filesystem' (or "
                "'nccl' with the vllm backend)")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        resolved_key = cfg.inference.resolved_api_key()
        if not lay.shared and not resolved_key:
            # servers on nodes of their own bind every interface, which needs a key; a fresh
            # one travels in the job's environment (sbatch exports ours), never in a file
            env["PRIMERL_API_KEY"] = secrets.token_urlsafe(32)
        if not lay.prefill:  # with prefill/decode the two pools say how many servers run
            cfg.inference.replicas = lay.servers
        cfg.output_dir = str(out)
        run_dir.logs.mkdir(parents=True, exist_ok=True)
        # what the job's processes read (dry_run is the launcher's, not the job's)
        run_dir.config.write_text(dump_toml(to_dict(attrs.evolve(cfg, launcher=attrs.evolve(lc, dry_run=False)))))
        try:
            paths = write_scripts(cfg, run_dir, lay, Path.cwd())
        except ValueError as exc:
            raise PrimerlError(str(exc)) from None
        _check_syntax(paths)
        batch = paths[0]
        if lc.dry_run:
            print(f"slurm job for {lay.describe(cfg)}:")
            for p in paths:
                print(f"  {p}")
            print(f"  {run_dir.config}  (the config every process reads)")
            key = "" if lay.shared or resolved_key else " with PRIMERL_API_KEY set (the servers bind every interface)"
            print(f"dry run: nothing submitted; `sbatch {batch}`{key} runs it.")
            return 0

        sbatch = shutil.which("sbatch")
        if sbatch is None:
            raise PrimerlError(f"sbatch not found on PATH: {INSTALL}")
        r = subprocess.run([sbatch, "--parsable", str(batch)], env=env, capture_output=True, text=True)
        if r.returncode != 0 or not r.stdout.strip():
            raise PrimerlError(f"sbatch refused the job ({batch}): {_one_line(r.stderr or r.stdout)}")
        job = r.stdout.strip().splitlines()[-1].split(";")[0]
        return self._follow(cfg, run_dir, job)

    # ----------------------------------------------------------------------------------

    def _follow(self, cfg: RunConfig, run_dir: RunDir, job: str) -> int:
        from primerl.runview import LiveView

        def on_signal(signum, _frame):
            raise Interrupted(signal.Signals(signum).name)

        old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        view = LiveView(cfg, run_dir)
        slurm = Slurm(job)
        clear_beacons(run_dir)
        # the job's processes run on its nodes: the watchdog reads their beacons from the run
        # directory and asks them for their stacks there; it counts from when the job runs
        dog: Watchdog | None = None

        def urls() -> list[str]:
            started = read_runtime(run_dir.root)
            return list(started.inference_urls) if started is not None else []

        try:
            with view:
                _note(view, f"submitted Slurm job {job} ({run_dir.root / 'slurm' / BATCH}); "
                            f"its log: {run_dir.logs / f'slurm-{job}.out'}")
                seen, last_poll, unreachable_since = None, 0.0, None
                while True:
                    view.refresh()
                    if time.monotonic() - last_poll >= POLL_SLURM_SECONDS:
                        last_poll = time.monotonic()
                        state = slurm.state()
                        if state is None:
                            unreachable_since = unreachable_since or time.monotonic()
                            if time.monotonic() - unreachable_since > GIVE_UP_SECONDS:
                                view.stop()
                                print(f"\nerror: lost track of Slurm job {job} ({slurm.error}); it may still run: "
                                      f"`squeue -j {job}`, `scancel {job}`", file=sys.stderr)
                                return 1
                        else:
                            unreachable_since = None
                            shown = (state.state, state.reason if state.state == "PENDING" else "")
                            if shown != seen:
                                seen = shown
                                where = f" on {state.nodes}" if state.state == "RUNNING" and state.nodes else ""
                                why = f" ({state.reason})" if shown[1] and shown[1] != "None" else ""
                                _note(view, f"Slurm job {job}: {state.state}{where}{why}")
                            if state.state in FINAL:
                                break
                            if state.state == "RUNNING" and dog is None:
                                dog = Watchdog(cfg, run_dir, names=lambda role: role, logs=None, urls=urls)
                    if dog is not None and (stall := dog.check()) is not None:
                        line = (f"the run made no progress for {cfg.watchdog.stall_timeout_s:.0f} s: {stall.stage} "
                                f"(every process's waits and stacks: {stall.report})")
                        if cfg.watchdog.on_stall == "exit":
                            view.stop()
                            slurm.cancel()
                            print(f"\nerror: {line}; cancelled Slurm job {job} (watchdog.on_stall = \"exit\"; the "
                                  f"same command resumes it from its newest checkpoint)", file=sys.stderr)
                            return STALLED
                        _note(view, f"warning: {line}; still waiting (watchdog.on_stall = \"wait\")")
                    time.sleep(0.5)
                view.refresh()
        except Interrupted as exc:
            view.stop()
            print(f"\n{exc.args[0]}: cancelling Slurm job {job}...", file=sys.stderr)
            slurm.cancel()
            print(f"cancelled; everything written so far is in {run_dir.root}", file=sys.stderr)
            return 130
        finally:
            for s, h in old.items():
                signal.signal(s, h)
        return self._outcome(run_dir, job, slurm)

    def _outcome(self, run_dir: RunDir, job: str, slurm: Slurm) -> int:
        final = slurm.final()
        status = _read_status(run_dir.root / "slurm" / f"job-{job}.status")
        rc = int(status["rc"]) if status.get("rc", "").isdigit() else -1
        if final.state == "COMPLETED" and rc in (0, -1):
            summarize(run_dir, logs_note="  (slurm-<job>.out: the batch script)",
                      extra=(("job scripts", run_dir.root / "slurm"),))
            return 0
        job_log = run_dir.logs / f"slurm-{job}.out"
        role = status.get("role")
        if role and role != "job":
            log = _role_log(run_dir, role)
            print(f"\nerror: {status.get('message', role + ' failed')}; the job (Slurm {job}) stopped the others.",
                  file=sys.stderr)
            if log:
                print(_tail(log), file=sys.stderr)
                print(f"Full log: {log}", file=sys.stderr)
        else:
            why = f" ({final.reason})" if final.reason and final.reason != "None" else ""
            code = f", exit code {final.exit_code}" if final.exit_code not in (None, "") else ""
            msg = status.get("message") or f"it ended {final.state}{why}{code}"
            print(f"\nerror: Slurm job {job}: {msg}", file=sys.stderr)
            if job_log.exists():
                print(_tail(job_log), file=sys.stderr)
                print(f"Full log: {job_log}", file=sys.stderr)
            else:
                print(f"the job wrote no log at {job_log}: is {run_dir.root} on a filesystem its nodes share?",
                      file=sys.stderr)
        if rc > 0:
            return min(rc, 255)
        code = final.exit_code.split(":")[0] if final.exit_code else ""
        return int(code) if code.isdigit() and 0 < int(code) < 256 else 1


# --------------------------------------------------------------------------------------
# Slurm's commands
# --------------------------------------------------------------------------------------


class JobState:
    def __init__(self, state: str, reason: str = "", nodes: str = "", exit_code: str | None = None):
        self.state = state.split()[0].rstrip("+") if state else "UNKNOWN"  # "CANCELLED by 0" -> CANCELLED
        self.reason, self.nodes, self.exit_code = reason, nodes, exit_code


class Slurm:
    """One job, seen through squeue, scontrol and sacct (whichever answers: a job leaves
    squeue after MinJobAge; sacct needs accounting)."""

    def __init__(self, job: str):
        self.job, self.error = job, ""

    def _run(self, *cmd: str) -> str | None:
        exe = shutil.which(cmd[0])
        if exe is None:
            self.error = f"{cmd[0]} not found on PATH"
            return None
        try:
            r = subprocess.run([exe, *cmd[1:]], capture_output=True, text=True, timeout=60)
        except subprocess.TimeoutExpired:
            self.error = f"{cmd[0]} did not answer in 60 s"
            return None
        if r.returncode != 0:
            self.error = f"{cmd[0]}: {_one_line(r.stderr or r.stdout)}"
            return None
        return r.stdout

    def state(self) -> JobState | None:
        out = self._run("squeue", "-h", "-j", self.job, "-t", "all", "-o", "%T|%r|%N")
        if out and out.strip():
            state, reason, nodes = (out.strip().splitlines()[0].split("|") + ["", ""])[:3]
            return JobState(state, reason, nodes)
        return self.final(missing_ok=True)

    def final(self, missing_ok: bool = False) -> JobState | None:
        """The job's state with its exit code (``rc:signal``), from scontrol, else sacct."""
        out = self._run("scontrol", "show", "job", "-o", self.job)
        if out and out.strip():
            fields = dict(re.findall(r"(\w+)=(\S*)", out))
            return JobState(fields.get("JobState", ""), fields.get("Reason", ""), fields.get("NodeList", ""),
                            fields.get("ExitCode"))
        out = self._run("sacct", "-n", "-P", "-X", "-j", self.job, "-o", "State,ExitCode,NodeList")
        if out and out.strip():
            state, code, nodes = (out.strip().splitlines()[0].split("|") + ["", ""])[:3]
            return JobState(state, "", nodes, code)
        return None if missing_ok else JobState("UNKNOWN")

    def cancel(self) -> None:
        """scancel, then wait (a while) for the job to leave the running states."""
        if self._run("scancel", self.job) is None:
            print(f"scancel {self.job} failed ({self.error}); cancel it by hand", file=sys.stderr)
            return
        deadline = time.monotonic() + CANCEL_WAIT_SECONDS
        while time.monotonic() < deadline:
            try:
                st = self.state()
                if st is None or st.state in FINAL:
                    return
                time.sleep(1.0)
            except Interrupted:
                return  # a second Ctrl-C: stop waiting; the job was cancelled


# --------------------------------------------------------------------------------------


def _note(view, message: str) -> None:
    note = getattr(view, "note", None)
    if note:
        note(message)
    else:
        view.console.print(message, style="yellow", highlight=False, markup=False)


def _check_syntax(paths: list[Path]) -> None:
    bash = shutil.which("bash")
    if bash is None:
        return
    for p in paths:
        r = subprocess.run([bash, "-n", str(p)], capture_output=True, text=True)
        if r.returncode != 0:
            raise PrimerlError(f"the generated {p} is not valid bash (a bug in primerl_slurm): {_one_line(r.stderr)}")


def _read_status(path: Path) -> dict[str, str]:
    try:
        text = path.read_text()
    except OSError:
        return {}
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def _role_log(run_dir: RunDir, role: str) -> Path | None:
    """The role's log (``inference.log``), or the newest of its per-task logs (``inference-3.log``)."""
    one = run_dir.logs / f"{role}.log"
    if one.exists():
        return one
    many = sorted(run_dir.logs.glob(f"{role}-*.log"), key=lambda p: p.stat().st_mtime)
    return many[-1] if many else None


def _one_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return " / ".join(lines[-3:]) if lines else "no output"


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
