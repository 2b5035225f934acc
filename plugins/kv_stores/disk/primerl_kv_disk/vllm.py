"""What the ``disk`` store needs from vLLM (``--inference.backend vllm``): LMCache's connector
with its local disk tier in the run's KV folder. Light: imports nothing but the contract."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from primerl.kv_stores import VllmConnector

__all__ = ["connector"]


def connector(options: Mapping[str, Any], directory: Path) -> VllmConnector:
    """``LMCacheConnectorV1`` (every server reads and writes, ``kv_both``) keeping chunks of 256
    tokens in CPU memory and up to 64 GB in ``directory``. LMCache publishes CUDA wheels only:
    vLLM's GPU build."""
    return VllmConnector(
        transfer_config={"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"},
        env={"LMCACHE_LOCAL_DISK": f"file://{directory}/", "LMCACHE_MAX_LOCAL_DISK_SIZE": "64",
             "LMCACHE_LOCAL_CPU": "True", "LMCACHE_CHUNK_SIZE": "256"},
        devices=("cuda",),
    )
