"""The local launcher for primerl."""
