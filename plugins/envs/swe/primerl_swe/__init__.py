"""primerl-env-swe: SWE-bench-format tasks in a sandbox.

Modules: ``plugin`` (entry point), ``sandbox`` (bubblewrap with resource limits),
``repo`` (scratch checkouts, patches, running tests), ``env`` (the tool-using agent
environment and ``primerl env check swe``), ``build_tasks`` (builds the shipped task set).
"""
