"""The slurm launcher: a whole run as one Slurm job, followed live, cancelled cleanly.

    primerl run --model glm5 --env swe --launcher slurm --launcher.nodes 28 [--dry-run]

``primerl run`` resolves the config and hands it here. We write ``OUT/config.toml`` and the
job (``OUT/slurm/primerl.sbatch``, see ``scripts.py``; ``OUT/slurm/processes.txt`` lists
where each process will run), submit it with ``sbatch`` (unless ``--dry-run`` /
``launcher.dry_run``: then we stop after writing), follow it with ``squeue``
(``scontrol``/``sacct`` once it has left the queue), show the local launcher's live view
(``primerl.runview.LiveView``: it reads ``metrics.jsonl``, which lands in the run directory
wherever the trainer runs) with the warnings the job writes to its log, and ``scancel`` the
job on Ctrl-C or SIGTERM. The run's exit code is the job's: 0 when the trainer finished its
last step; otherwise the failing process's code, and the cause from its log; a node the job
lost is named, and the same command resumes the run.

The job runs the run's processes itself (``primerl_slurm.job`` on its first node, under
:class:`primerl.supervisor.Supervisor`, the local launcher's policy): restarts, stalls and
failures are handled there, next to the processes, and the job works the same when it is
submitted by hand or requeued. Why one job whose processes are ``srun`` steps, rather than
a heterogeneous job or a job per role chained with dependencies:

* every process must run at the same time and stop together. In one job the supervisor
  follows its steps and stops all of them when one fails; ``scancel`` of one id stops
  everything; nothing is left queued when a process dies (dependent jobs would be);
* the addresses (inference URLs, the trainer's rendezvous, the Mooncake master) exist only
  once nodes are allocated. The job sees every node at once and writes them for the
  processes (the run-time record, ``OUT/runtime.json``) before starting any; separate jobs
  would have to find each other through files while queued at different times;
* one node is the same job: all processes on it as overlapping steps (``srun --overlap``).
  Components of a heterogeneous job are separate allocations, which cannot share a node.

What the processes need from the cluster: the run directory (``--output-dir``) and this
Python environment on a filesystem every node sees; the nodes reaching each other over TCP.
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
from primerl.runview import LiveView, summarize
from primerl.supervisor import tail
from primerl_slurm.config import SlurmConfig
from primerl_slurm.scripts import BATCH, Layout, layout, write_scripts

POLL_SLURM_SECONDS = 5.0  # squeue is asked this often (the view refreshes every 0.5 s)
GIVE_UP_SECONDS = 300.0  # Slurm unreachable this long: stop following (the job runs on)
CANCEL_WAIT_SECONDS = 90.0
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL",
         "DEADLINE", "REVOKED", "SPECIAL_EXIT"}
INSTALL = ("install Slurm's client commands (Debian/Ubuntu: apt-get install slurm-client) or run on a login "
           "node; --dry-run writes the job scripts without them")
SUBMITTED = "submitted"  # OUT/slurm/submitted: the id of the newest job submitted for the run
JOB_LINE = re.compile(r"^\[\d\d:\d\d:\d\d\] ((?:warning|error): .*)$")  # a line of the job's log shown live


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
        if not lc.dry_run:
            _refuse_a_running_job(run_dir)
        # a finished run or another config is refused; an unfinished run continues from its
        # newest usable checkpoint (primerl.resume; the job runs it again when Slurm requeues)
        for note in prepare_run(cfg, dry_run=lc.dry_run).notes:
            print(note, flush=True)
        lay = self._layout(cfg)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        resolved_key = cfg.inference.resolved_api_key()
        if not lay.shared and not resolved_key:
            # servers on nodes of their own bind every interface, which needs a key; a fresh
            # one travels in the job's environment (sbatch exports ours), never in a file
            env["PRIMERL_API_KEY"] = secrets.token_urlsafe(32)
        if not lay.prefill:  # with prefill/decode the two pools say how many servers run
            cfg.inference.replicas = lay.servers
        cfg.output_dir = str(run_dir.root)
        run_dir.logs.mkdir(parents=True, exist_ok=True)
        # what the job's processes read (dry_run is the launcher's, not the job's)
        run_dir.config.write_text(dump_toml(to_dict(attrs.evolve(cfg, launcher=attrs.evolve(lc, dry_run=False)))))
        try:
            paths = write_scripts(cfg, run_dir, lay, Path.cwd())
        except ValueError as exc:
            raise PrimerlError(str(exc)) from None
        _check_syntax(paths[:1])
        batch = paths[0]
        if lc.dry_run:
            print(f"slurm job for {lay.describe(cfg)}:")
            for p in paths:
                print(f"  {p}")
            print(f"  {run_dir.config}  (the config every process reads)")
            key = "" if lay.shared or resolved_key else " with PRIMERL_API_KEY set (the servers bind every interface)"
            print(f"dry run: nothing submitted; `sbatch {batch}`{key} runs it.")
            return 0
        return self._follow(cfg, run_dir, _submit(batch, env, run_dir))

    @staticmethod
    def _layout(cfg: RunConfig) -> Layout:
        try:
            lay = layout(cfg)
        except ValueError as exc:
            raise PrimerlError(str(exc)) from None
        if not lay.shared and cfg.trainer.weight_channel == "shm":
            raise PrimerlError(
                "trainer.weight_channel = 'shm' hands weights over in /dev/shm, which only servers on the trainer's "
                "node can read, and launcher.nodes > 1 puts them on nodes of their own: use 'filesystem' (or "
                "'nccl' with the vllm backend)")
        return lay

    # ----------------------------------------------------------------------------------

    def _follow(self, cfg: RunConfig, run_dir: RunDir, job: str) -> int:
        def on_signal(signum, _frame):
            raise Interrupted(signal.Signals(signum).name)

        old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        view = LiveView(cfg, run_dir)
        follower = Follower(job, run_dir, view)
        try:
            with view:
                view.note(f"submitted Slurm job {job} ({run_dir.root / 'slurm' / BATCH}); "
                          f"its log: {run_dir.logs / f'slurm-{job}.out'}")
                while not follower.turn():
                    view.refresh()
                    time.sleep(0.5)
                view.refresh()
        except Interrupted as exc:
            view.stop()
            print(f"\n{exc.args[0]}: cancelling Slurm job {job}...", file=sys.stderr)
            follower.slurm.cancel()
            print(f"cancelled; everything written so far is in {run_dir.root}", file=sys.stderr)
            return 130
        finally:
            for s, h in old.items():
                signal.signal(s, h)
        if follower.lost_track:
            print(f"\nerror: lost track of Slurm job {job} ({follower.slurm.error}); it may still run: "
                  f"`squeue -j {job}`, `scancel {job}`", file=sys.stderr)
            return 1
        return self._outcome(run_dir, job, follower)

    def _outcome(self, run_dir: RunDir, job: str, follower: Follower) -> int:
        final = follower.slurm.final()
        status = _read_status(run_dir.root / "slurm" / f"job-{job}.status")
        rc = int(status["rc"]) if status.get("rc", "").isdigit() else -1
        if final.state == "COMPLETED" and rc in (0, -1):
            summarize(run_dir, logs_note="  (slurm-<job>.out: the job's own process: nodes, steps, why it ended)",
                      extra=(("job scripts", run_dir.root / "slurm"),))
            return 0
        if final.state == "NODE_FAIL":
            print(f"\nerror: {_node_lost(run_dir, job, follower.lost())}", file=sys.stderr)
            return 1
        role, message = status.get("role"), status.get("message", "")
        if role == "watchdog":
            print(f"\nerror: {message}; stopped Slurm job {job} (watchdog.on_stall = \"exit\"; the same command "
                  f"resumes it from its newest checkpoint)", file=sys.stderr)
        elif role and role != "job":
            log = run_dir.log(role)
            print(f"\nerror: {message or role + ' failed'}; the job (Slurm {job}) stopped the others.", file=sys.stderr)
            if log.exists():
                print(tail(log), file=sys.stderr)
                print(f"Full log: {log}", file=sys.stderr)
        else:
            _job_ended(run_dir, job, final, message)
        if rc > 0:
            return min(rc, 255)
        code = final.exit_code.split(":")[0] if final.exit_code else ""
        return int(code) if code.isdigit() and 0 < int(code) < 256 else 1


def _submit(batch: Path, env: dict[str, str], run_dir: RunDir) -> str:
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise PrimerlError(f"sbatch not found on PATH: {INSTALL}")
    r = subprocess.run([sbatch, "--parsable", str(batch)], env=env, capture_output=True, text=True)
    if r.returncode != 0 or not r.stdout.strip():
        raise PrimerlError(f"sbatch refused the job ({batch}): {_one_line(r.stderr or r.stdout)}")
    job = r.stdout.strip().splitlines()[-1].split(";")[0]
    (run_dir.root / "slurm" / SUBMITTED).write_text(job + "\n")
    return job


def _refuse_a_running_job(run_dir: RunDir) -> None:
    """A job submitted earlier for this run directory that Slurm still runs or holds: the
    run is refused, one line (two jobs must never write one run)."""
    try:
        job = (run_dir.root / "slurm" / SUBMITTED).read_text().strip()
    except OSError:
        return
    if not job or shutil.which("squeue") is None:
        return
    slurm = Slurm(job)
    deadline = time.monotonic() + 60
    while (state := slurm.queued()) == "COMPLETING" and time.monotonic() < deadline:
        time.sleep(1)  # ending: its steps are being stopped
    if state:
        raise PrimerlError(f"Slurm job {job} still runs this run ({state} in squeue; {run_dir.root}): wait for it to "
                           f"end or `scancel {job}`, then run the same command again to resume")


def _job_ended(run_dir: RunDir, job: str, final: JobState, message: str) -> None:
    job_log = run_dir.logs / f"slurm-{job}.out"
    why = f" ({final.reason})" if final.reason and final.reason != "None" else ""
    code = f", exit code {final.exit_code}" if final.exit_code not in (None, "") else ""
    print(f"\nerror: Slurm job {job}: {message or f'it ended {final.state}{why}{code}'}", file=sys.stderr)
    if job_log.exists():
        print(tail(job_log), file=sys.stderr)
        print(f"Full log: {job_log}", file=sys.stderr)
    else:
        print(f"the job wrote no log at {job_log}: is {run_dir.root} on a filesystem its nodes share?",
              file=sys.stderr)


def _node_lost(run_dir: RunDir, job: str, lost: list[str], requeued: bool = False) -> str:
    """One line: which node the job lost, where the run got to, and how it goes on."""
    from primerl.resume import usable_checkpoint

    steps = len([line for line in run_dir.metrics.read_text().splitlines() if line.strip()]) \
        if run_dir.metrics.exists() else 0
    ckpt = usable_checkpoint(run_dir)
    where = f"from its checkpoint at step {ckpt[0]}" if ckpt else "from the start (no checkpoint yet)"
    after = (f"Slurm requeued the job: it resumes {where} once Slurm has its nodes" if requeued else
             f"the same command resumes it {where}")
    if not lost and requeued:  # preempted, or requeued by hand
        return f"Slurm job {job} went back to the queue after step {steps}; {after}"
    nodes = ", ".join(lost) if lost else "one of its nodes"
    return (f"Slurm job {job} lost node {nodes} (NODE_FAIL: its slurmd stopped answering) after step {steps}; "
            f"{after}")


class Follower:
    """``primerl run``'s view of its job: its state as Slurm says it, the nodes it runs on,
    the warnings it writes, a requeue or a lost node."""

    def __init__(self, job: str, run_dir: RunDir, view: LiveView) -> None:
        self.job, self.run_dir, self.view = job, run_dir, view
        self.slurm = Slurm(job)
        self.last_poll, self.unreachable_since = 0.0, None
        self.shown: tuple[str, str] | None = None
        self.nodes = ""  # where it ran last
        # its nodes Slurm had down or not responding at the last look while it ran: a lost
        # node is named even when it is back in service by the time the job is seen requeued
        self.unanswering: list[str] = []
        self.lost_track = False
        self.log_offset = 0

    def turn(self) -> bool:
        """One look (Slurm every POLL_SLURM_SECONDS); True once the job has ended."""
        self._show_job_lines()
        if time.monotonic() - self.last_poll < POLL_SLURM_SECONDS:
            return False
        self.last_poll = time.monotonic()
        state = self.slurm.state()
        if state is None:
            self.unreachable_since = self.unreachable_since or time.monotonic()
            self.lost_track = time.monotonic() - self.unreachable_since > GIVE_UP_SECONDS
            return self.lost_track
        self.unreachable_since = None
        shown = (state.state, state.reason if state.state == "PENDING" else "")
        if shown != self.shown:
            if state.state == "PENDING" and self.shown and self.shown[0] in ("RUNNING", "COMPLETING"):
                self.view.note(f"warning: {_node_lost(self.run_dir, self.job, self.lost(), requeued=True)}")
            self.shown = shown
            where = f" on {state.nodes}" if state.state == "RUNNING" and state.nodes else ""
            why = f" ({state.reason})" if shown[1] and shown[1] != "None" else ""
            self.view.note(f"Slurm job {self.job}: {state.state}{where}{why}")
        if state.state == "RUNNING" and state.nodes:
            self.nodes = state.nodes
            self.unanswering = self.lost_nodes()
        return state.state in FINAL

    def lost(self) -> list[str]:
        """The job's lost nodes: those Slurm has down now, else those that did not answer
        Slurm at the last look while the job ran (back in service since)."""
        return self.lost_nodes() or self.unanswering

    def lost_nodes(self) -> list[str]:
        """The nodes the job ran on that Slurm now has down or not responding."""
        if not self.nodes:
            return []
        out = self.slurm.run("sinfo", "-h", "-N", "-n", self.nodes, "-o", "%N %T") or ""
        return sorted({name for name, state in (line.split() for line in out.splitlines() if len(line.split()) == 2)
                       if state.endswith("*") or state.startswith(("down", "fail"))})

    def _show_job_lines(self) -> None:
        """The warnings and errors the job's process wrote since the last look, in the view."""
        log = self.run_dir.logs / f"slurm-{self.job}.out"
        try:
            with open(log, errors="replace") as f:
                f.seek(self.log_offset)
                text = f.read()
        except OSError:
            return
        complete = text[:text.rfind("\n") + 1]
        self.log_offset += len(complete.encode())
        for line in complete.splitlines():
            if m := JOB_LINE.match(line):
                self.view.note(m.group(1))


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

    def run(self, *cmd: str) -> str | None:
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

    def queued(self) -> str:
        """The job's state while squeue lists it as pending, running or completing ("" once
        it is not)."""
        out = self.run("squeue", "-h", "-j", self.job, "-o", "%T")
        return out.strip().splitlines()[0] if out and out.strip() else ""

    def state(self) -> JobState | None:
        out = self.run("squeue", "-h", "-j", self.job, "-t", "all", "-o", "%T|%r|%N")
        if out and out.strip():
            state, reason, nodes = (out.strip().splitlines()[0].split("|") + ["", ""])[:3]
            return JobState(state, reason, nodes)
        return self.final(missing_ok=True)

    def final(self, missing_ok: bool = False) -> JobState | None:
        """The job's state with its exit code (``rc:signal``), from scontrol, else sacct."""
        out = self.run("scontrol", "show", "job", "-o", self.job)
        if out and out.strip():
            fields = dict(re.findall(r"(\w+)=(\S*)", out))
            return JobState(fields.get("JobState", ""), fields.get("Reason", ""), fields.get("NodeList", ""),
                            fields.get("ExitCode"))
        out = self.run("sacct", "-n", "-P", "-X", "-j", self.job, "-o", "State,ExitCode,NodeList")
        if out and out.strip():
            state, code, nodes = (out.strip().splitlines()[0].split("|") + ["", ""])[:3]
            return JobState(state, "", nodes, code)
        return None if missing_ok else JobState("UNKNOWN")

    def cancel(self) -> None:
        """scancel, then wait (a while) for the job to leave the running states."""
        if self.run("scancel", self.job) is None:
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


def _one_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return " / ".join(lines[-3:]) if lines else "no output"
