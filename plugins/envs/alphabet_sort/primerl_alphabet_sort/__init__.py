"""primerl-env-alphabet-sort: a multi-turn sorting environment."""
