"""vf-reverse-v1: reverse a short text, written as verifiers' docs show a v1 environment (a
taskset of tasks, a reward function; played by the null harness). The reward is the
similarity of the reply to the reversed text (partial credit, so a small model can climb).

The texts are words from a short fixed list by default, which a tiny model can learn to
reverse within minutes of RL on a CPU; ``letters = true`` draws random lowercase strings
instead (reversing those needs real copying, far harder for a tiny model).
"""

import difflib
import random
import string

import verifiers.v1 as vf

WORDS = ["apple", "river", "stone", "cloud", "green", "light", "north", "quiet", "swift", "table", "water", "amber",
         "brick", "dance", "eagle", "flame", "grape", "honey", "jelly", "kite", "lemon", "maple", "night", "ocean",
         "pearl", "queen", "robin", "sugar", "tiger", "wheat", "bread", "chair", "dream", "field", "glass", "heart",
         "juice", "knife", "lunch", "music", "olive", "piano", "radio", "salt", "train", "voice", "whale", "moon",
         "star", "sun", "rain", "snow", "wind", "leaf"]


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
    letters: bool = False  # random lowercase strings instead of words
    min_len: int = 3  # of a random string
    max_len: int = 6
    seed: int = 0


class ReverseTaskset(vf.Taskset[ReverseTask, ReverseConfig]):
    def load(self):
        c = self.config
        rng = random.Random(c.seed)
        for i in range(c.num_tasks):
            if c.letters:
                text = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(c.min_len, c.max_len)))
            else:
                text = rng.choice(WORDS)
            yield ReverseTask(ReverseData(id=f"r{i}", prompt=f"Reverse the text: {text}", answer=text[::-1]),
                              self.config.task)


__all__ = ["ReverseTaskset"]
