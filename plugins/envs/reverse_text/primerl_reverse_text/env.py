"""reverse-text: the model sees a short text and must write it backwards.

Why this task: it is the smallest task on which RL visibly works on a laptop CPU. The
reward is dense (a longest-common-subsequence ratio, not pass/fail), so a tiny model
warmed up with a little SFT starts with partial credit and RL can push it up within
minutes. Data are generated locally from a fixed word list and a seed: nothing is
downloaded.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Iterator

import attrs

from primerl.envs import EnvConfig, SingleTurnEnv, Task
from primerl_reverse_text.words import BASIC, ENGLISH_EVAL, ENGLISH_TRAIN

WORDS = BASIC  # the quick start's words



def lcs_length(a: str, b: str) -> int:
    """Length of the longest common subsequence (O(len(a)*len(b)) dynamic programme)."""
    if not a or not b:
        return 0
    prev = [0] * (len(b) + 1)
    for ca in a:
        cur = [0]
        for j, cb in enumerate(b, 1):
            cur.append(prev[j - 1] + 1 if ca == cb else max(prev[j], cur[j - 1]))
        prev = cur
    return prev[-1]


def lcs_ratio(completion: str, target: str) -> float:
    """2 * LCS / (len(completion) + len(target)): 1 for an exact match, 0 for nothing shared."""
    total = len(completion) + len(target)
    return 2.0 * lcs_length(completion, target) / total if total else 1.0


def _check_lengths(inst: ReverseTextConfig, _attr: attrs.Attribute, value: int) -> None:
    if value < inst.min_words:
        raise ValueError(f"max_words ({value}) must be >= min_words ({inst.min_words})")


@attrs.define(kw_only=True)
class ReverseTextConfig(EnvConfig):
    name: str = "reverse-text"
    # the words texts are made of: "basic", the quick start's 68 (train and eval tasks draw
    # from all of them), or "english", about a thousand common words of which every fifth
    # only ever appears in eval tasks (a held-out test of reversing, not of the answers)
    words: str = attrs.field(default="basic", validator=attrs.validators.in_(("basic", "english")))
    min_words: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    max_words: int = attrs.field(default=1, validator=_check_lengths)
    num_train: int = attrs.field(default=20000, validator=attrs.validators.ge(1))
    num_eval: int = attrs.field(default=200, validator=attrs.validators.ge(1))
    # Simulated verifier latency (benchmarks of long-tail rollouts): each reward call sleeps
    # a log-normal time with this median, whose p99 is `latency_tail` times the median.
    latency_s: float = attrs.field(default=0.0, validator=attrs.validators.ge(0.0))
    latency_tail: float = attrs.field(default=20.0, validator=attrs.validators.ge(1.0))


class ReverseText(SingleTurnEnv):
    """Reverse a short text character by character."""

    Config = ReverseTextConfig
    system_prompt = None  # the instruction is in the prompt: short prompts keep CPU steps fast

    # Settings under which `primerl run --model glm5 --env reverse-text` learns visibly on
    # a laptop CPU in a few minutes; any file or flag overrides them.
    run_defaults = {
        "max_steps": 300,
        # a short warm-up: the model learns the format and a little reversing; sampling at
        # temperature 1.3 then starts RL near 0.35 with room to climb (RL here mostly
        # sharpens what the warm-up taught; a long warm-up leaves it nothing to do)
        "sft": {"steps": 70, "lr": 3e-3, "batch_size": 32},
        "orchestrator": {"batch_size": 64, "group_size": 8, "max_tokens": 24, "temperature": 1.3,
                         "async_level": 1, "max_off_policy_steps": 4, "advantage": "grpo_std"},
        # Adam moves every weight by about lr per step: RL on a 1M-parameter model wants a small lr
        # a step's rows in one forward (fewer, larger ops); rows of 512 tokens hold whole
        # groups (prompt trees: one prompt, 8 completions), so few rows end part-empty, and
        # a model with varlen_rows runs them as one row without padding (about 2-3 rows a step)
        "trainer": {"lr": 4e-4, "seq_len": 512, "micro_batch_rows": 32, "warmup_steps": 2},
        "inference": {"max_model_len": 256, "max_batch_size": 64, "kv_slots": 160},
    }
    # A pretrained instruct model (model.checkpoint) already writes answers: no warm-up on
    # the task's own answers, sampling at its trained temperature, and a learning rate for
    # real weights (the preset's 4e-4 moves them so far in one step that samples one version
    # old no longer match the policy: completions collapse and mismatch KL jumps above 1)
    pretrained_run_defaults = {
        "sft": {"steps": 0},
        "orchestrator": {"batch_size": 64, "group_size": 8, "temperature": 1.0},
        "trainer": {"lr": 1e-5, "warmup_steps": 0},
    }

    def _text(self, rng: random.Random, split: str) -> str:
        if self.config.words == "english":
            words = ENGLISH_TRAIN if split == "train" else ENGLISH_EVAL
        else:
            words = WORDS
        n = rng.randint(self.config.min_words, self.config.max_words)
        return " ".join(rng.choice(words) for _ in range(n))

    def tasks(self, split: str) -> Iterator[Task]:
        if split not in ("train", "eval"):
            raise ValueError(f"reverse-text has splits 'train' and 'eval', not {split!r}")
        # each split has its own seed stream, so the same seed gives the same tasks
        count = self.config.num_train if split == "train" else self.config.num_eval
        rng = random.Random(f"{self.config.seed}-{split}")
        for i in range(count):
            text = self._text(rng, split)
            yield Task(id=f"{split}-{i}", prompt=f"Reverse: {text}", answer=text[::-1], info={"text": text})

    def reward(self, task: Task, completion: str) -> float:
        if self.config.latency_s > 0:
            sigma = math.log(self.config.latency_tail) / 2.3263  # z of the 99th percentile
            time.sleep(self.config.latency_s * math.exp(random.gauss(0.0, sigma)))
        return lcs_ratio(completion.strip(), task.answer or "")
