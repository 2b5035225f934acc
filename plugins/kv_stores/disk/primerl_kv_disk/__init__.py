"""The ``disk`` KV store (see :mod:`primerl_kv_disk.store`)."""
