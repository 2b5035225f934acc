"""Alphabet sort: keep a growing list of names sorted, over several turns.

Turn 1 gives a few names; every later turn adds more and asks for the whole list again,
sorted (``--env.turns`` turns, 3 by default; ``--env.max_turns`` can cut episodes
shorter). The model answers with the names separated by commas. Each turn scores the
similarity of its list to the right one (difflib's ratio over the sequences of names, 1
for an exact answer); the reward is the mean over all turns, and a turn never answered
counts 0. This needs the model to carry the conversation: later answers must contain the
names of earlier turns.
"""

from __future__ import annotations

import difflib
import random
from collections.abc import Iterator
from typing import Any

import attrs

from primerl.envs import Task
from primerl.envs.multiturn import MultiTurnConfig, MultiTurnEnv, Turn

NAMES = ["Ada", "Alan", "Alice", "Amir", "Anna", "Ben", "Bruno", "Carl", "Chen", "Clara", "Dan", "Dora", "Eli", "Emma", "Eva", "Felix", "Finn", "Gia", "Grace", "Hana", "Hugo", "Ida", "Ivan", "Jack", "Jade", "Jon", "Kai", "Kara", "Leo", "Lena", "Liam", "Lucy", "Maya", "Max", "Mia", "Nia", "Noah", "Nora", "Olaf", "Omar", "Otto", "Paul", "Pia", "Quinn", "Rosa", "Ruth", "Sam", "Sara", "Sofia", "Tara", "Theo", "Tom", "Uma", "Vera", "Vik", "Wes", "Yara", "Yuki", "Zoe", "Zora"]


def parse_names(text: str) -> list[str]:
    return [p.strip() for p in text.replace("\n", ",").split(",") if p.strip()]


def similarity(answer: list[str], truth: list[str]) -> float:
    return difflib.SequenceMatcher(a=answer, b=truth, autojunk=False).ratio()


@attrs.define(kw_only=True)
class AlphabetSortConfig(MultiTurnConfig):
    turns: int = attrs.field(default=3, validator=attrs.validators.in_(range(1, 11)))  # the game's length
    names_per_turn: int = attrs.field(default=3, validator=attrs.validators.in_(range(1, 11)))
    num_train: int = attrs.field(default=5000, validator=attrs.validators.ge(1))
    num_eval: int = attrs.field(default=100, validator=attrs.validators.ge(1))


class AlphabetSort(MultiTurnEnv):
    Config = AlphabetSortConfig
    system_prompt = "Sort names alphabetically. Answer with the sorted names separated by commas, nothing else."
    run_defaults = {
        "orchestrator": {"batch_size": 16, "group_size": 4, "max_tokens": 48, "temperature": 1.0,
                         "async_level": 1, "max_off_policy_steps": 4},
        "trainer": {"lr": 4e-4, "seq_len": 512},
        "inference": {"max_model_len": 512, "kv_slots": 64},
    }
    # a pretrained instruct model (model.checkpoint): a learning rate for real weights
    pretrained_run_defaults = {"trainer": {"lr": 1e-5}}

    def tasks(self, split: str) -> Iterator[Task]:
        if split not in ("train", "eval"):
            raise ValueError(f"alphabet-sort has splits 'train' and 'eval', not {split!r}")
        rng = random.Random(f"{self.config.seed}-{split}")
        count = self.config.num_train if split == "train" else self.config.num_eval
        k, turns = self.config.names_per_turn, self.config.turns
        for i in range(count):
            names = rng.sample(NAMES, k * turns)
            batches = [names[t * k:(t + 1) * k] for t in range(turns)]
            yield Task(id=f"{split}-{i}", prompt=f"Sort: {', '.join(batches[0])}",
                       answer=", ".join(sorted(batches[0])), info={"batches": batches})

    def setup(self, task: Task) -> dict[str, Any]:
        return {"turn": 0, "scores": []}

    def respond(self, task: Task, state: dict[str, Any], completion: str) -> Turn:
        batches = task.info["batches"]
        t = state["turn"]
        truth = sorted(n for b in batches[: t + 1] for n in b)
        state["scores"].append(similarity(parse_names(completion), truth))
        state["turn"] = t + 1
        if state["turn"] >= len(batches):
            return Turn(done=True)
        new = ", ".join(batches[state["turn"]])
        return Turn([{"role": "user", "content": f"Add: {new}. Give the whole list, sorted."}])

    def reward(self, task: Task, state: dict[str, Any]) -> float:
        return sum(state["scores"]) / len(task.info["batches"])
