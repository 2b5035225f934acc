"""Entry point module: registers the environment lazily (importing this loads nothing heavy)."""

from primerl import hookimpl


@hookimpl
def register_envs(register):
    register(
        "reverse-text",
        "primerl_reverse_text.env:ReverseText",
        description="Reverse a short text; reward = LCS ratio with the reversed text",
    )
