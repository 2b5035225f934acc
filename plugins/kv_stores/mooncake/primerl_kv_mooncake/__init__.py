"""The ``mooncake`` KV store (see :mod:`primerl_kv_mooncake.store`) and a master launcher
(:mod:`primerl_kv_mooncake.master`)."""
