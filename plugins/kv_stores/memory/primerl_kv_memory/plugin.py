"""Entry point module: registers the memory KV store lazily (nothing heavy at import)."""

from primerl import hookimpl
from primerl.kv_stores import KVStoreCapabilities


@hookimpl
def register_kv_stores(register):
    register(
        "memory",
        "primerl_kv_memory.store:MemoryStore",
        description="Idle prefixes kept in the engine's free KV slots, least recently used evicted first",
        # under --inference.backend vllm, vLLM's own prefix cache does the same job
        capabilities=KVStoreCapabilities(vllm_prefix_cache=True),
    )
