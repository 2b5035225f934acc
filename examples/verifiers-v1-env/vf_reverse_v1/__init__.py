"""vf-reverse-v1: reverse a short text, written as verifiers' docs show a v1 environment (a
taskset of tasks, a reward function; played by the null harness). The reward is the
similarity of the reply to the reversed text (partial credit, so a small model can climb)."""

import difflib
import random
import string

import verifiers.v1 as vf


class ReverseData(vf.TaskData):
    answer: str


class ReverseTask(vf.Task[ReverseData]):
    @vf.reward(weight=1.0)
    async def similarity(self, task: ReverseData, trace: vf.Trace) -> float:
        reply = (trace.last_reply or "").strip()
        return difflib.SequenceMatcher(None, reply, task.answer).ratio()

    @vf.metric
    async def exact(self, task: ReverseData, trace: vf.Trace) -> float:
        return float((trace.last_reply or "").strip() == task.answer)


class ReverseConfig(vf.TasksetConfig):
    num_tasks: int = 2000
    min_len: int = 3
    max_len: int = 6
    seed: int = 0


class ReverseTaskset(vf.Taskset[ReverseTask, ReverseConfig]):
    def load(self):
        rng = random.Random(self.config.seed)
        for i in range(self.config.num_tasks):
            text = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(self.config.min_len,
                                                                                         self.config.max_len)))
            yield ReverseTask(ReverseData(id=f"r{i}", prompt=f"Reverse the text: {text}", answer=text[::-1]),
                              self.config.task)


__all__ = ["ReverseTaskset"]
