"""Entry point module: registers the embedded backend lazily (no torch at import)."""

from primerl import hookimpl


@hookimpl
def register_inference_backends(register):
    register(
        "embedded",
        "primerl_embedded.backend:EmbeddedBackend",
        description="Our torch engine: continuous batching, prefix reuse, live weight updates (CPU or GPU)",
    )
