"""Wordle as a multi-turn environment.

Each episode hides a 5-letter word from the shipped list. Every model turn is a guess
(the last 5-letter word in the reply); the env answers with feedback per letter — ``G``
right letter in the right place, ``Y`` in the word elsewhere, ``-`` not in the word
(repeated letters counted as in the real game) — until the word is found or 6 guesses
are spent. Reward: (7 - guesses) / 6 when solved (1 for a first-guess win, 1/6 for a
sixth), else 0.1 * the best guess's share of green letters, so that a tiny model gets
some signal before it ever wins.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from collections.abc import Iterator
from typing import Any

import attrs

from primerl.envs import Task
from primerl.envs.multiturn import MultiTurnConfig, MultiTurnEnv, Turn

WORDS = ["about", "above", "actor", "acute", "adult", "after", "again", "agent", "agree", "ahead", "alarm", "album", "alert", "alike", "alive", "allow", "alone", "along", "alter", "among", "anger", "angle", "angry", "apart", "apple", "apply", "arena", "argue", "arise", "array", "aside", "asset", "audio", "audit", "avoid", "award", "aware", "badly", "baker", "bases", "basic", "beach", "began", "begin", "being", "below", "bench", "billy", "birth", "black", "blame", "blind", "block", "blood", "board", "boost", "booth", "bound", "brain", "brand", "bread", "break", "breed", "brief", "bring", "broad", "broke", "brown", "build", "built", "buyer", "cable", "calif", "carry", "catch", "cause", "chain", "chair", "chart", "chase", "cheap", "check", "chest", "chief", "child", "china", "chose", "civil", "claim", "class", "clean", "clear", "click", "clock", "close", "coach", "coast", "could", "count", "court", "cover", "craft", "crash", "cream", "crime", "cross", "crowd", "crown", "curve", "cycle", "daily", "dance", "dated", "dealt", "death", "debut", "delay", "depth", "doing", "doubt", "dozen", "draft", "drama", "drawn", "dream", "dress", "drill", "drink", "drive", "drove", "dying", "eager", "early", "earth", "eight", "elite", "empty", "enemy", "enjoy", "enter", "entry", "equal", "error", "event", "every", "exact", "exist", "extra", "faith", "false", "fault", "fiber", "field", "fifth", "fifty", "fight", "final", "first", "fixed", "flash", "fleet", "floor", "fluid", "focus", "force", "forth", "forty", "forum", "found", "frame", "frank", "fraud", "fresh", "front", "fruit", "fully", "funny", "giant", "given", "glass", "globe", "going", "grace", "grade", "grand", "grant", "grass", "great", "green", "gross", "group", "grown", "guard", "guess", "guest", "guide", "happy", "heart", "heavy", "hence", "horse", "hotel", "house", "human", "ideal", "image", "index", "inner", "input", "issue", "joint", "judge", "known", "label", "large", "laser", "later", "laugh", "layer", "learn", "lease", "least", "leave", "legal", "level", "light", "limit", "links", "lives", "local", "logic", "loose", "lower", "lucky", "lunch", "lying", "magic", "major", "maker", "march", "match", "maybe", "mayor", "meant", "media", "metal", "might", "minor", "minus", "mixed", "model", "money", "month", "moral", "motor", "mount", "mouse", "mouth", "movie", "music", "needs", "never", "newly", "night", "noise", "north", "noted", "novel", "nurse", "ocean", "offer", "often", "order", "other", "ought", "paint", "panel", "paper", "party", "peace", "phase", "phone", "photo", "piece", "pilot", "pitch", "place", "plain", "plane", "plant", "plate", "point", "pound", "power", "press", "price", "pride", "prime", "print", "prior", "prize", "proof", "proud", "prove", "queen", "quick", "quiet", "quite", "radio", "raise", "range", "rapid", "ratio", "reach", "ready", "refer", "right", "rival", "river", "robin", "rough", "round", "route", "royal", "rural", "scale", "scene", "scope", "score", "sense", "serve", "seven", "shall", "shape", "share", "sharp", "sheet", "shelf", "shell", "shift", "shirt", "shock", "shoot", "short", "shown", "sight", "since", "sixth", "sixty", "sized", "skill", "sleep", "slide", "small", "smart", "smile", "smith", "smoke", "solid", "solve", "sorry", "sound", "south", "space", "spare", "speak", "speed", "spend", "spent", "split", "spoke", "sport", "staff", "stage", "stake", "stand", "start", "state", "steam", "steel", "stick", "still", "stock", "stone", "stood", "store", "storm", "story", "strip", "stuck", "study", "stuff", "style", "sugar", "suite", "super", "sweet", "table", "taken", "taste", "taxes", "teach", "teeth", "thank", "theft", "their", "theme", "there", "these", "thick", "thing", "think", "third", "those", "three", "threw", "throw", "tight", "times", "tired", "title", "today", "topic", "total", "touch", "tough", "tower", "track", "trade", "train", "treat", "trend", "trial", "tried", "tries", "truck", "truly", "trust", "truth", "twice", "under", "undue", "union", "unity", "until", "upper", "upset", "urban", "usage", "usual", "valid", "value", "video", "virus", "visit", "vital", "voice", "waste", "watch", "water", "wheel", "where", "which", "while", "white", "whole", "whose", "woman", "women", "world", "worry", "worse", "worst", "worth", "would", "wound", "write", "wrong", "wrote", "yield", "young", "youth"]

MAX_GUESSES = 6
_WORD = re.compile(r"\b([a-zA-Z]{5})\b")


def feedback(guess: str, secret: str) -> str:
    """Per letter: G (right place), Y (elsewhere in the word), - (absent), with real
    Wordle's handling of repeated letters."""
    marks = ["-"] * 5
    left = Counter(s for g, s in zip(guess, secret) if g != s)
    for i, (g, s) in enumerate(zip(guess, secret)):
        if g == s:
            marks[i] = "G"
        elif left[g] > 0:
            marks[i] = "Y"
            left[g] -= 1
    return "".join(marks)


@attrs.define(kw_only=True)
class WordleConfig(MultiTurnConfig):
    max_turns: int = attrs.field(default=MAX_GUESSES, validator=attrs.validators.in_(range(1, MAX_GUESSES + 1)))
    num_train: int = attrs.field(default=2000, validator=attrs.validators.ge(1))
    num_eval: int = attrs.field(default=100, validator=attrs.validators.ge(1))


class Wordle(MultiTurnEnv):
    Config = WordleConfig
    system_prompt = ("Play Wordle. Guess the secret 5-letter English word. Reply with one guess, a single "
                     "5-letter word. After each guess you get one mark per letter: G = right letter, right place; "
                     "Y = in the word, elsewhere; - = not in the word.")
    run_defaults = {
        "orchestrator": {"batch_size": 16, "group_size": 4, "max_tokens": 12, "temperature": 1.0,
                         "async_level": 1, "max_off_policy_steps": 4},
        "trainer": {"lr": 4e-4, "seq_len": 512},
        "inference": {"max_model_len": 512, "kv_slots": 64},
    }
    # a pretrained instruct model (model.checkpoint): a learning rate for real weights
    pretrained_run_defaults = {"trainer": {"lr": 1e-5}}

    def tasks(self, split: str) -> Iterator[Task]:
        if split not in ("train", "eval"):
            raise ValueError(f"wordle has splits 'train' and 'eval', not {split!r}")
        rng = random.Random(f"{self.config.seed}-{split}")
        count = self.config.num_train if split == "train" else self.config.num_eval
        for i in range(count):
            secret = rng.choice(WORDS)
            yield Task(id=f"{split}-{i}", prompt="Your first guess?", answer=secret)

    def setup(self, task: Task) -> dict[str, Any]:
        return {"guesses": [], "marks": [], "solved": False}

    def respond(self, task: Task, state: dict[str, Any], completion: str) -> Turn:
        words = _WORD.findall(completion)  # "my guess is crane": the last 5-letter word is the guess
        if not words:
            state["guesses"].append("")
            state["marks"].append("")
            msg = "That is not a 5-letter word. Guess again."
        else:
            guess = words[-1].lower()
            marks = feedback(guess, task.answer)
            state["guesses"].append(guess)
            state["marks"].append(marks)
            state["solved"] = marks == "GGGGG"
            msg = f"{guess} {marks}"
        done = state["solved"] or len(state["guesses"]) >= self.config.max_turns
        left = self.config.max_turns - len(state["guesses"])
        return Turn([{"role": "user", "content": msg if done else f"{msg}\n{left} guesses left."}], done=done)

    def reward(self, task: Task, state: dict[str, Any]) -> float:
        if state["solved"]:
            return (MAX_GUESSES + 1 - len(state["guesses"])) / MAX_GUESSES
        return 0.1 * max((m.count("G") / 5 for m in state["marks"]), default=0.0)
