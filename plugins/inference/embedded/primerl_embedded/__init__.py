"""primerl's embedded inference backend: our own engine behind an OpenAI-compatible API."""
