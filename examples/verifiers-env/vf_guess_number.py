"""Guess the number: a multi-turn environment written with the verifiers library (classic API).

The model guesses an integer in a range; after each guess the environment answers
"higher", "lower" or "correct". Reward: 1 for finding it on the first try, less for each
extra guess, 0 when the turns run out. The data is generated here (no download).

It is the kind of environment people publish for verifiers, kept small: primerl's tests
train on it through the verifiers bridge, and ``vf-eval`` can run it against any
OpenAI-compatible server, primerl's included.
"""

from __future__ import annotations

import random
import re

import verifiers as vf
from datasets import Dataset

PROMPT = ("I am thinking of an integer from {lo} to {hi}. Guess it: answer with just the number. "
          "After each guess I say higher, lower or correct.")


class GuessNumberEnv(vf.MultiTurnEnv):
    async def env_response(self, messages: vf.Messages, state: vf.State, **kwargs) -> vf.Messages:
        guess = parse_guess(messages[-1])
        target = int(state["answer"])
        state.setdefault("guesses", []).append(guess)
        if guess == target:
            state["solved"] = True
            state["final_env_response"] = [{"role": "user", "content": "correct"}]
            return state["final_env_response"]
        if guess is None:
            return [{"role": "user", "content": "Answer with just a number."}]
        return [{"role": "user", "content": "higher" if guess < target else "lower"}]


def parse_guess(message) -> int | None:
    content = message.get("content") if hasattr(message, "get") else getattr(message, "content", None)
    found = re.search(r"-?\d+", content or "")
    return int(found.group()) if found else None


def solved_in_few_guesses(state: vf.State, **kwargs) -> float:
    if not state.get("solved"):
        return 0.0
    return 1.0 / len(state["guesses"])


def load_environment(num_examples: int = 64, low: int = 1, high: int = 9, max_turns: int = 3,
                     seed: int = 0) -> vf.Environment:
    rng = random.Random(seed)
    rows = [{"question": PROMPT.format(lo=low, hi=high), "answer": str(rng.randint(low, high))}
            for _ in range(num_examples)]
    rubric = vf.Rubric(funcs=[solved_in_few_guesses])
    return GuessNumberEnv(dataset=Dataset.from_list(rows), rubric=rubric, max_turns=max_turns)
