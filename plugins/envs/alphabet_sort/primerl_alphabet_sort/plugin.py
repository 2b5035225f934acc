"""Entry point module: registers the environment lazily."""

from primerl import hookimpl


@hookimpl
def register_envs(register):
    register("alphabet-sort", "primerl_alphabet_sort.env:AlphabetSort",
             description="Sort names alphabetically; each turn adds names and asks for the whole list (multi-turn)")
