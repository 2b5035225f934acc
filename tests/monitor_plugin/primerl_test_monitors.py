"""Monitors that fail, for tests/test_monitors.py: one whose library is not installed (its
``start`` imports a module that does not exist, as the wandb monitor does without wandb),
one whose ``log`` raises at step 2, and one that records what it was given. Found as an
installed plugin through the ``.dist-info`` beside it (the e2e test puts this folder on
``PYTHONPATH``); the fast tests load the module by path."""

import attrs

from primerl import hookimpl
from primerl.monitors import MonitorConfig


@attrs.define(kw_only=True)
class FlakyConfig(MonitorConfig):
    fail_at: int = 2  # the step whose log raises


class NeedsMissingLibrary:
    Config = MonitorConfig  # no keys of its own

    def __init__(self, options):
        self.options = options

    def start(self, run):
        import a_monitoring_library_that_is_not_installed  # noqa: F401

    def log(self, step, metrics):
        raise AssertionError("never started, never called")

    def log_samples(self, step, rows):
        raise AssertionError("never started, never called")

    def finish(self):
        pass


class Flaky:
    Config = FlakyConfig

    def __init__(self, options):
        self.options = options
        self.finished = 0

    def start(self, run):
        self.out = run.output_dir

    def log(self, step, metrics):
        if step == self.options.fail_at:
            raise RuntimeError(f"flaky monitor fails at step {step}")

    def log_samples(self, step, rows):
        pass

    def finish(self):
        self.finished += 1


class Recorder:
    """Keeps every call (the fast tests read it back from ``Recorder.last``)."""

    Config = MonitorConfig
    last = None

    def __init__(self, options):
        self.options = options
        self.calls = []
        Recorder.last = self

    def start(self, run):
        self.calls.append(("start", run.start_step))

    def log(self, step, metrics):
        self.calls.append(("log", step, dict(metrics)))

    def log_samples(self, step, rows):
        self.calls.append(("log_samples", step, list(rows)))

    def finish(self):
        self.calls.append(("finish",))


@hookimpl
def register_monitors(register):
    register("needs-missing-lib", NeedsMissingLibrary, description="a monitor whose library is not installed")
    register("flaky", Flaky, description="a monitor whose log raises at step fail_at")
    register("recorder", Recorder, description="a monitor that keeps what it is given")
    register("unloadable", "primerl_test_monitors_no_such_module:Monitor", description="a target that does not import")
