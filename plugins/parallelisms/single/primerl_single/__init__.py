"""The ``single`` parallelism strategy: one trainer process, nothing sharded."""
