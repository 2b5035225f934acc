"""A KV store from outside the repository, written where a test asks: its module and its
``.dist-info`` with the ``primerl`` entry point, as pip leaves an installed plugin. Put the
folder on a process's ``PYTHONPATH`` (:func:`env_with`) and primerl discovers it; nothing in
this environment changes and no other test sees it.

The store declares a run service (an address it hands every server's store: ``pool``, with
the launch it was started for) and a vLLM connector of its own (``ThirdPartyKVConnector``,
given that address); for the embedded engine it is the memory store.
"""

from __future__ import annotations

import os
from pathlib import Path

STORE = "third-party-kv"
CONNECTOR = "ThirdPartyKVConnector"

PLUGIN = '''
"""The third party's entry point module: one KV store, what it needs from vLLM and from a launcher."""
from primerl import hookimpl
from primerl.kv_stores import KVStoreCapabilities


@hookimpl
def register_kv_stores(register):
    register("third-party-kv", "primerl_kv_third.store:build", description="a KV store from elsewhere",
             capabilities=KVStoreCapabilities(run_service="primerl_kv_third.service:run_service",
                                              vllm_connector="primerl_kv_third.vllm:connector"))
'''
STORE_MODULE = '''
"""For the embedded engine: the memory store, built through the registry."""
from primerl.registry import get_registry


def build(**options):
    return get_registry().load("kv_store", "memory")()
'''
SERVICE = '''
"""The store's run service: where it listens is what every server's store (and vLLM's
connector) gets."""


class Pool:
    def __init__(self, site):
        self.site = site

    def options(self):
        return {"pool": f"{self.site.host}:{self.site.port}", "launch": self.site.launch}

    def describe(self):
        return f"third-party pool at {self.site.host}:{self.site.port}"

    def alive(self):
        return None  # nothing runs: the pool is an address

    def stop(self):
        pass


def run_service(cfg, site):
    return Pool(site)
'''
VLLM = '''
"""What the store needs from vLLM: its own connector (a module outside vLLM), its pool's address."""
from primerl.kv_stores import VllmConnector


def connector(options, directory):
    return VllmConnector(
        transfer_config={"kv_connector": "ThirdPartyKVConnector", "kv_role": "kv_both",
                         "kv_connector_module_path": "primerl_kv_third.connector",
                         "kv_connector_extra_config": {"pool": options.get("pool", "unset")}},
        env={"THIRD_PARTY_KV_POOL": str(options.get("pool", "unset"))},
        files={str(directory / "third.json"): "{}"},
    )
'''


def write_store(root: Path) -> Path:
    """The third party's distribution in ``root`` (returned: the folder for ``PYTHONPATH``)."""
    pkg = root / "primerl_kv_third"
    pkg.mkdir(parents=True)
    for name, text in {"__init__.py": "", "plugin.py": PLUGIN, "store.py": STORE_MODULE, "service.py": SERVICE,
                       "vllm.py": VLLM}.items():
        (pkg / name).write_text(text.lstrip())
    info = root / "primerl_kv_third-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: primerl-kv-third\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[primerl]\nthird = primerl_kv_third.plugin\n")
    return root


def env_with(site: Path) -> dict[str, str]:
    """This environment with the store's folder first on ``PYTHONPATH``."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])}
