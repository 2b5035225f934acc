"""The one supervisor both launchers run (primerl.supervisor), on real child processes: what
each duty's exit means, restarts, services started first, stalls, signals, and the beacons of
processes on other nodes named by their host. No launcher and no Slurm needed."""

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from primerl.rundir import RunDir
from primerl.supervisor import Child, Duty, Outcome, Supervisor
from primerl.watchdog import BeaconRecord


class Cfg:
    class inference:
        max_restarts = 2

    class watchdog:
        stall_timeout_s = 0.0
        on_stall = "exit"


class Said:
    """A reporter that keeps what it is told."""

    def __init__(self) -> None:
        self.notes: list[str] = []
        self.ended: list[Outcome] = []

    def tick(self) -> None:
        pass

    def note(self, line: str) -> None:
        self.notes.append(line)

    def stopping(self, outcome: Outcome) -> None:
        self.ended.append(outcome)


def py(code: str) -> tuple[str, ...]:
    return (sys.executable, "-c", code)


def child(run: RunDir, name: str, duty: Duty, code: str, **kw) -> Child:
    return Child(name=name, duty=duty, command=py(code), log=run.log(name), **kw)


@pytest.fixture
def run(tmp_path) -> RunDir:
    r = RunDir(tmp_path / "run")
    r.logs.mkdir(parents=True)
    return r


def test_the_run_finishes_when_every_trainer_exits_0_and_stops_the_rest(run):
    said = Said()
    kids = [child(run, "inference", Duty.SERVES, "import time; time.sleep(60)"),
            child(run, "orchestrator", Duty.WORKS, "pass"),  # done early: fine
            child(run, "trainer-0", Duty.FINISHES, "import time; time.sleep(0.5)"),
            child(run, "trainer-1", Duty.FINISHES, "import time; time.sleep(1.5)")]
    sup = Supervisor(Cfg, run, kids, said, grace=5)
    t0 = time.monotonic()
    outcome = sup.run()
    assert outcome.code == 0 and outcome.message == "the trainer finished its last step"
    assert 1.4 < time.monotonic() - t0 < 10  # the last trainer node, not the first
    assert all(p.poll() is not None for p in sup.procs.values())  # the server was stopped
    assert said.ended == [outcome]


def test_a_failing_process_fails_the_run_naming_it_and_its_node(run):
    kids = [child(run, "inference", Duty.SERVES, "import time; time.sleep(60)"),
            child(run, "trainer", Duty.FINISHES, "import time; time.sleep(60)", node="node7"),
            child(run, "orchestrator", Duty.WORKS, "import sys; print('boom'); sys.exit(5)")]
    outcome = Supervisor(Cfg, run, kids, Said(), grace=5).run()
    assert (outcome.code, outcome.child, outcome.log) == (5, "orchestrator", run.log("orchestrator"))
    assert outcome.message == "the orchestrator process exited with code 5"
    assert run.log("orchestrator").read_text() == "boom\n"
    kids[1] = child(run, "trainer", Duty.FINISHES, "import sys; sys.exit(1)", node="node7")
    kids[2] = child(run, "orchestrator", Duty.WORKS, "import time; time.sleep(60)")
    outcome = Supervisor(Cfg, run, kids, Said(), grace=5).run()
    assert outcome.message == "the trainer process on node7 exited with code 1" and outcome.code == 1


def test_a_server_is_restarted_while_another_serves_then_left_then_the_last_fails_the_run(run):
    """Server a dies at once, every time: restarted twice (max_restarts), its log appended
    each time, then left; b serves meanwhile and, once it exits, none is left."""
    said = Said()
    kids = [child(run, "inference-0", Duty.SERVES, "import sys; print('up'); sys.exit(9)"),
            child(run, "inference-1", Duty.SERVES, "import time; time.sleep(4); raise SystemExit(7)"),
            child(run, "trainer", Duty.FINISHES, "import time; time.sleep(60)")]
    outcome = Supervisor(Cfg, run, kids, said, grace=5).run()
    assert [n.split(";")[1].strip() for n in said.notes] == [
        "restarting it (1 of at most 2), 1 of 2 inference servers serve meanwhile (log: "
        f"{run.log('inference-0')})", "restarting it (2 of at most 2), 1 of 2 inference servers serve meanwhile "
        f"(log: {run.log('inference-0')})", f"1 of 2 inference servers left, the run goes on (log: {run.log('inference-0')})"]
    assert said.notes[0].startswith("warning: the inference-0 process exited with code 9")
    assert run.log("inference-0").read_text().splitlines() == [
        "up", "[primerl] the server exited with code 9; restarting it (1 of at most 2)",
        "up", "[primerl] the server exited with code 9; restarting it (2 of at most 2)", "up"]
    assert outcome.code == 7 and outcome.child == "inference-1"
    assert outcome.message == "every inference process exited (the last, inference-1, with code 7)"


@pytest.mark.parametrize("code", [2, 143])
def test_a_server_with_a_config_error_or_stopped_on_purpose_is_not_restarted(run, code):
    said = Said()
    kids = [child(run, "inference-0", Duty.SERVES, f"raise SystemExit({code})"),
            child(run, "inference-1", Duty.SERVES, "import time; time.sleep(60)"),
            child(run, "trainer", Duty.FINISHES, "import time; time.sleep(2)")]
    assert Supervisor(Cfg, run, kids, said, grace=5).run().code == 0
    assert len(said.notes) == 1 and "1 of 2 inference servers left" in said.notes[0]


def test_services_serve_before_anything_else_starts_and_their_exit_fails_the_run(run):
    marker = run.root / "serving"
    started: list[str] = []
    kids = [child(run, "mooncake", Duty.SUPPORTS,
                  f"import time, pathlib; time.sleep(1); pathlib.Path({str(marker)!r}).touch(); time.sleep(2)",
                  ready=marker.exists),
            child(run, "trainer", Duty.FINISHES, f"import pathlib; assert pathlib.Path({str(marker)!r}).exists(); "
                                                  "import time; time.sleep(60)")]
    sup = Supervisor(Cfg, run, kids, Said(), grace=5, services_ready=lambda: started.append("record"))
    outcome = sup.run()
    assert started == ["record"]  # once, after the service served and before the trainer started
    assert outcome.message == "the mooncake process exited with code 0" and outcome.child == "mooncake"
    kids[0] = child(run, "mooncake", Duty.SUPPORTS, "raise SystemExit(4)", ready=lambda: False)
    outcome = Supervisor(Cfg, run, kids, Said(), grace=5, services_ready=lambda: started.append("again")).run()
    assert outcome.message == "the mooncake process exited with code 4 before serving" and started == ["record"]


BEACON = """
import sys, time
from primerl import watchdog
from primerl.rundir import RunDir
class Cfg:
    class watchdog:
        stall_timeout_s = 1.0
watchdog.start(sys.argv[1], RunDir(sys.argv[2]), Cfg)
watchdog.doing("waiting for nothing")
time.sleep(120)
"""


def test_a_run_without_progress_is_stopped_with_the_stuck_stage_in_one_line(run):
    run.config.write_text("")  # a launched run: beacons start
    said = Said()

    class Stalls(Cfg):
        class watchdog:
            stall_timeout_s = 1.5
            on_stall = "exit"

    kids = [Child(name="orchestrator", duty=Duty.WORKS, command=(sys.executable, "-c", BEACON, "orchestrator",
                                                                   str(run.root)), log=run.log("orchestrator"),
                  beacon="orchestrator"),
            child(run, "trainer", Duty.FINISHES, "import time; time.sleep(60)")]
    outcome = Supervisor(Stalls, run, kids, said, grace=5).run()
    assert outcome.stalled and outcome.code == 3, outcome
    assert outcome.message.startswith("the run made no progress for 2 s: no process reports a wait: orchestrator: "
                                      "waiting for nothing")
    report = (run.logs / "watchdog.log").read_text()
    assert "== orchestrator (pid" in report and "stacks written to orchestrator.log after SIGUSR1" in report


def test_sigterm_stops_every_process_and_says_so(run):
    kids = [child(run, "inference", Duty.SERVES, "import time; time.sleep(60)"),
            child(run, "trainer", Duty.FINISHES, "import time; time.sleep(60)")]
    sup = Supervisor(Cfg, run, kids, Said(), grace=5)
    before = signal.getsignal(signal.SIGTERM)  # another test may have set one: the supervisor gives it back
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
    outcome = sup.run()
    assert (outcome.code, outcome.signal) == (143, "SIGTERM")
    assert all(p.poll() is not None for p in sup.procs.values())
    assert signal.getsignal(signal.SIGTERM) is before  # the launcher's handlers are back


def test_beacons_are_named_by_role_and_host(run):
    kids = [child(run, name, Duty.FINISHES, "pass", node=node, beacon="trainer")
            for name, node in (("trainer-0", "n1"), ("trainer-1", "n2.cluster"))]
    kids.append(child(run, "inference-1", Duty.SERVES, "pass", node="n0", beacon="inference:8001"))
    sup = Supervisor(Cfg, run, kids, Said())

    def record(role: str, host: str) -> BeaconRecord:
        return BeaconRecord(role=role, pid=1, time=0.0, progress=0, doing="", doing_since=0.0, busy=False, waits=(),
                            children=(), host=host)

    assert sup.name_of(record("trainer-3", "n2")) == "trainer-1"  # rank 3, on the second trainer node
    assert sup.name_of(record("trainer-0", "n1.cluster")) == "trainer-0"
    assert sup.name_of(record("inference:8001", "n0")) == "inference-1"
    assert sup.name_of(record("inference:8001", "n5")) == "inference:8001"  # nobody's: its own role
    assert json.loads(record("x", "h").to_json())["host"] == "h"
    assert BeaconRecord.from_json(json.dumps({**json.loads(record("x", "h").to_json()), "host": ""})).host == ""


def test_processes_left_running_die_with_the_supervisor(run, tmp_path):
    """The supervisor SIGKILLed (a lost launcher): its children go too (PR_SET_PDEATHSIG)."""
    import subprocess

    script = tmp_path / "sup.py"
    script.write_text(f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_supervisor import Cfg, Said, child
from primerl.rundir import RunDir
from primerl.supervisor import Duty, Supervisor
run = RunDir({str(run.root)!r})
Supervisor(Cfg, run, [child(run, "trainer", Duty.FINISHES, "import os, time; print(os.getpid(), flush=True); "
                                                           "time.sleep(60)")], Said()).run()
""")
    sup = subprocess.Popen([sys.executable, str(script)])
    deadline = time.time() + 30
    while not run.log("trainer").read_text().strip() if run.log("trainer").exists() else True:
        assert time.time() < deadline and sup.poll() is None
        time.sleep(0.1)
    pid = int(run.log("trainer").read_text())
    sup.kill()
    sup.wait()
    deadline = time.time() + 10
    while Path(f"/proc/{pid}").exists() and time.time() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
