"""The verifiers bridge: environments built with the verifiers library, trained by primerl."""
