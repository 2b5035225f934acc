"""The ``memory`` KV store (:mod:`primerl_kv_memory.store`): idle prefixes in the engine's free KV slots."""
