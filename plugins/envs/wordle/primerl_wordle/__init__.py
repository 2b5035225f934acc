"""primerl-env-wordle: the Wordle game as a multi-turn environment."""
