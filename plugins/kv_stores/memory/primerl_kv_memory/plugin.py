"""Entry point module: registers the memory KV store lazily (nothing heavy at import)."""

from primerl import hookimpl


@hookimpl
def register_kv_stores(register):
    register(
        "memory",
        "primerl.kv_memory:MemoryStore",
        description="Idle prefixes kept in the engine's free KV slots, least recently used evicted first",
    )
