"""A primerl plugin whose environment never answers a turn: the tool call that never
returns, for the watchdog's end-to-end test. Found as an installed plugin through the
``.dist-info`` beside it (the test puts this folder on ``PYTHONPATH``)."""

import time

from primerl import hookimpl
from primerl.envs import Task
from primerl.envs.multiturn import MultiTurnEnv


class NeverAnswers(MultiTurnEnv):
    def tasks(self, split):
        for i in range(10_000):
            yield Task(id=f"stuck-{i}", prompt="say something")

    def respond(self, task, state, completion):
        time.sleep(3600)  # a tool call that never returns

    def reward(self, task, state):
        return 0.0


@hookimpl
def register_envs(register):
    register("never-answers", "primerl_stuck_env:NeverAnswers", description="an env whose turns never return")
