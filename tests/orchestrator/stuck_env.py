"""A multi-turn env whose first turn blocks until the test says go, for the env-worker
fault tests (imported by name in spawned workers, so it lives in a module)."""

import os
import time
from pathlib import Path

from primerl.envs import Task
from primerl.envs.multiturn import MultiTurnEnv, Turn

DIR = "PRIMERL_TEST_STUCK_DIR"  # where each blocked worker writes its pid; a "go" file there releases them


class Stuck(MultiTurnEnv):
    system_prompt = None

    def tasks(self, split):
        for i in range(8):
            yield Task(id=f"t{i}", prompt=f"task {i}")

    def respond(self, task, state, completion):
        d = Path(os.environ[DIR])
        (d / f"{os.getpid()}.pid").write_text(task.id)
        while not (d / "go").exists():
            time.sleep(0.05)
        return Turn([], done=True)

    def reward(self, task, state):
        return 1.0
