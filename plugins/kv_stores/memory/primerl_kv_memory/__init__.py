"""The ``memory`` KV store (see :mod:`primerl_kv_memory.store`)."""
