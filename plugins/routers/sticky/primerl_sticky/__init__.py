"""The ``sticky`` router plugin (see :mod:`primerl_sticky.router`)."""
