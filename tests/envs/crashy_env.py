"""Environments that misbehave on purpose, for the worker-process tests (imported by name
in spawned workers, so they live in a module, not in the test file)."""

import os
import time

from primerl.envs import Task, TaskError
from primerl.envs.multiturn import MultiTurnEnv, Turn


class Crashy(MultiTurnEnv):
    def tasks(self, split):
        yield Task(id="t", prompt="go")

    def respond(self, task, state, completion):
        if completion == "hang":
            time.sleep(3600)
        if completion == "die":
            os._exit(3)
        if completion == "raise":
            raise RuntimeError("env bug")
        if completion == "harness":
            raise TaskError("no python here", task_id=task.id)
        state["n"] = state.get("n", 0) + 1
        return Turn([{"role": "user", "content": f"ok {state['n']}"}], done=state["n"] >= 2)

    def reward(self, task, state):
        return 1.0

    def pid(self):
        return os.getpid()
