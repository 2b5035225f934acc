"""The watchdog's parts on hand-made beacons: what a stall is, and which stage it names."""

import socket
import time

from primerl import watchdog
from primerl.rundir import RunDir
from primerl.watchdog import BeaconRecord, Seen, Wait, Watchdog, diagnose

NOW = 1_000_000.0


def seen(name, state="S", doing="", waits=(), time_=NOW):
    record = BeaconRecord(role=name, pid=1, time=time_, progress=0, doing=doing, doing_since=NOW - 5, busy=False,
                          waits=tuple(waits), children=())
    return Seen(record, state, name)


def test_the_stuck_stage_is_named_in_order_of_cause():
    orch = seen("orchestrator", waits=[Wait("inference", "/v1/completions to http://a", NOW - 70),
                                       Wait("env", "wordle.step of task t3 in worker 9", NOW - 65)])
    trainer = seen("trainer", waits=[Wait("batch", "batch 4 from the orchestrator", NOW - 80)])
    up = {"http://a": None}
    assert diagnose([seen("inference", state="T"), orch, trainer], up, NOW).startswith(
        "inference not answering: the inference process (1) is stopped")
    assert diagnose([seen("trainer", state="T"), orch], up, NOW).startswith("the trainer process (1) is stopped")
    assert diagnose([orch, trainer], up, NOW) == \
        "an env worker inside a call: wordle.step of task t3 in worker 9, for 65 s"
    orch = seen("orchestrator", doing="filling batch 4", waits=[Wait("inference", "/v1/completions to http://a",
                                                                     NOW - 70)])
    assert diagnose([orch, trainer], {"http://a": "/health: ReadTimeout"}, NOW) == \
        "inference not answering: http://a (/health: ReadTimeout); the oldest request waits 70 s"
    assert "though every server answers /health" in diagnose([orch, trainer], up, NOW)
    orch = seen("orchestrator", doing="filling batch 4",
                waits=[Wait("weights", "inference loading policy v4 (from v3)", NOW - 30)])
    assert diagnose([orch, trainer], up, NOW) == \
        "a weight update not acknowledged: inference loading policy v4 (from v3), for 30 s"
    orch = seen("orchestrator", doing="filling batch 4")
    assert diagnose([orch, trainer], up, NOW) == \
        "the trainer waits 80 s for batch 4 from the orchestrator; the orchestrator: filling batch 4"
    assert "stopped reporting 60 s ago" in diagnose([seen("orchestrator", time_=NOW - 60), trainer], up, NOW)


def test_a_stall_is_reported_once_progress_stops_and_busy_work_is_progress(tmp_path, monkeypatch):
    class Cfg:
        class watchdog:
            stall_timeout_s = 0.3
            on_stall = "exit"

    run = RunDir(tmp_path)
    run.config.parent.mkdir(parents=True, exist_ok=True)
    run.config.write_text("")
    monkeypatch.setattr(watchdog, "_beacon", None)
    monkeypatch.setattr(watchdog, "STACKS_WAIT_S", 0.0)
    watchdog.start("orchestrator", run, Cfg)
    watchdog.doing("loading", busy=True)
    watchdog._beacon.write()
    dog = Watchdog(Cfg, run, names=lambda record: record.role, logs=lambda name: run.logs / f"{name}.log",
                   urls=lambda: [])
    assert dog.check() is None
    time.sleep(0.4)
    assert dog.check() is None  # busy: working, not stuck
    watchdog.doing("filling batch 1")
    with watchdog.waiting("env", "wordle.step of task t in worker 7"):
        watchdog._beacon.write()
        assert dog.check() is None  # the first look after busy work
        time.sleep(0.4)
        stall = dog.check()
    assert stall is not None and stall.stage.startswith("an env worker inside a call: wordle.step of task t")
    assert "waiting on env: wordle.step" in stall.report.read_text()
    watchdog.advance()
    watchdog._beacon.write()
    assert dog.check() is None  # progress again


def test_a_watchdog_on_another_machine_asks_for_stacks_through_the_run_directory(tmp_path, monkeypatch):
    """A Slurm job's case: a beacon written on another node (its host is not the watchdog's)
    gets no /proc look and no signal; it answers a request file with its stacks, and the
    report names its host."""
    class Cfg:
        class watchdog:
            stall_timeout_s = 0.2
            on_stall = "exit"

    run = RunDir(tmp_path)
    run.config.parent.mkdir(parents=True, exist_ok=True)
    run.config.write_text("")
    monkeypatch.setattr(watchdog, "_beacon", None)
    watchdog.start("trainer-0", run, Cfg)
    watchdog.doing("step 3 of 10")
    dog = Watchdog(Cfg, run, names=lambda record: record.role, logs=lambda name: run.logs / f"{name}.log",
                   urls=lambda: [], here="another-node")
    with watchdog.waiting("batch", "batch 3 from the orchestrator"):
        watchdog._beacon.write()
        assert dog.check() is None
        time.sleep(0.3)
        stall = dog.check()
    assert stall.stage.startswith("the trainer waits") and "batch 3 from the orchestrator" in stall.stage
    report = stall.report.read_text()
    assert "state unknown (another machine)" in report
    assert f"on {socket.gethostname()}," in report  # the beacon's own host
    assert "stacks:" in report and "in _loop" in report  # the beacon's own thread, from its .stacks file
