"""Entry point module: registers the disk KV store lazily (nothing heavy at import)."""

from primerl import hookimpl
from primerl.kv_stores import KVStoreCapabilities


@hookimpl
def register_kv_stores(register):
    register(
        "disk",
        "primerl_kv_disk.store:DiskStore",
        description="Idle prefixes in free KV slots; evicted ones written to files as blocks (LRU, bounded) and restored on a hit",
        capabilities=KVStoreCapabilities(shares_across_processes=True, run_service="primerl_kv_disk.store:run_service",
                                         vllm_connector="primerl_kv_disk.vllm:connector"),
    )
