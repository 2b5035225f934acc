"""The ``memory`` KV store (implemented in the core, :mod:`primerl.kv_memory`: the disk and mooncake stores build on it)."""
