"""The reverse-text environment for primerl."""
