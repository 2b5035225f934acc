"""What the ``mooncake`` store needs from vLLM (``--inference.backend vllm``): vLLM's
``MooncakeStoreConnector`` on the run's pool, its settings in a file written from the store's
options. Light: imports nothing but the contract."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from primerl.kv_stores import VllmConnector

__all__ = ["connector"]


def connector(options: Mapping[str, Any], directory: Path) -> VllmConnector:
    """``MooncakeStoreConnector`` (one pool shared by every server, ``kv_both``), reading
    ``directory/mooncake_config.json``: the master (the launcher's, through the run-time
    record), TCP unless ``protocol`` names RDMA, segment and buffer sizes. vLLM's GPU build."""
    path = Path(directory) / "mooncake_config.json"
    settings = {
        "metadata_server": "P2PHANDSHAKE",
        "master_server_address": options.get("master", "127.0.0.1:50051"),
        "global_segment_size": options.get("segment_bytes", "16GB"),
        "local_buffer_size": options.get("buffer_bytes", "4GB"),
        "protocol": options.get("protocol", "tcp"),
        "device_name": options.get("device", ""),
    }
    return VllmConnector(
        transfer_config={"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"},
        env={"MOONCAKE_CONFIG_PATH": str(path)},
        files={str(path): json.dumps(settings, indent=2) + "\n"},
        devices=("cuda",),
    )
