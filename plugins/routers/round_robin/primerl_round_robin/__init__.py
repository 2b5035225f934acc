"""The ``round-robin`` router plugin (see :mod:`primerl_round_robin.router`)."""
