"""Entry point module: registers the environment lazily."""

from primerl import hookimpl


@hookimpl
def register_envs(register):
    register("wordle", "primerl_wordle.env:Wordle",
             description="Wordle: guess a 5-letter word in 6 tries with letter feedback (multi-turn)")
