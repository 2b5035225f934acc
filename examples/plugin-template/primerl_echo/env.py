"""An environment written only against primerl's public contract."""

import random

from primerl.envs import SingleTurnEnv, Task


class EchoDigits(SingleTurnEnv):
    def tasks(self, split):
        rng = random.Random(split)
        for i in range(1000):
            n = str(rng.randint(0, 999))
            yield Task(id=f"{split}-{i}", prompt=f"Repeat: {n}", answer=n)

    def reward(self, task, completion):
        return 1.0 if completion.strip() == task.answer else 0.0
