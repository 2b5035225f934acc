"""Entry point module: registers the Mooncake KV store lazily (Mooncake is imported only
when the store is built)."""

from primerl import hookimpl
from primerl.kv_stores import KVStoreCapabilities


@hookimpl
def register_kv_stores(register):
    register(
        "mooncake",
        "primerl_kv_mooncake.store:MooncakeStore",
        description="KV blocks in a Mooncake Store pool shared by every inference server; idle prefixes in free slots",
        capabilities=KVStoreCapabilities(shares_across_processes=True,
                                         run_service="primerl_kv_mooncake.master:run_service",
                                         vllm_connector="primerl_kv_mooncake.vllm:connector"),
    )
