"""The embedded backend's ``[inference]`` section: the engine's own keys (``kv_slots``,
``max_queue``; unknown keys under any other backend) and the rules that need the whole run."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import ClassVar

import attrs

from primerl.config import RunConfig
from primerl.errors import ConfigError
from primerl.inference import InferenceConfig
from primerl.validators import positive


@attrs.define(kw_only=True)
class EmbeddedConfig(InferenceConfig):
    """The keys of ``[inference]`` that only the embedded engine has; under another backend
    they are unknown keys (an env's run defaults that set them are dropped there)."""

    # sequences the engine's KV cache holds, each max_model_len long (running ones and idle
    # cached prefixes); at least max_batch_size, more leaves room for prefix reuse
    kv_slots: int = attrs.field(default=128, validator=positive)
    # sequences that may wait for the engine; beyond it requests get 503 (Retry-After)
    max_queue: int = attrs.field(default=4096, validator=positive)

    may_change_on_resume: ClassVar[tuple[str, ...]] = (*InferenceConfig.may_change_on_resume, "max_queue")

    def check(self, run: RunConfig, sources: Mapping[str, str]) -> None:
        """Prefill/decode hands each prompt's KV from a prefill server to a decode server
        through the KV store, so the store must share KV across processes. When the user
        chose no store, one that does is chosen (and said); a chosen one that does not is
        refused."""
        if not self.disaggregated():
            return
        from primerl.registry import get_registry

        reg = get_registry()
        if reg.capabilities("kv_store", self.kv_store).shares_across_processes:
            return
        p, d = self.prefill_replicas, self.decode_replicas
        shared = [c.name for c in reg.components if c.kind == "kv_store" and c.error is None
                  and reg.capabilities("kv_store", c.name).shares_across_processes]
        if "inference.kv_store" not in sources and shared:
            pick = "disk" if "disk" in shared else shared[0]  # disk needs nothing but a folder
            print(f"note: inference.prefill_replicas / decode_replicas ({p} / {d}) hand KV between servers through "
                  f"the KV store, which must be shared: using inference.kv_store = {pick!r} (one of "
                  f"{', '.join(repr(n) for n in shared)}; set --inference.kv_store to choose)", file=sys.stderr)
            self.kv_store = pick
            return
        where = sources.get("inference.kv_store", "the defaults")
        fix = (" or ".join(f"--inference.kv_store {n}" for n in shared) if shared
               else "install a KV store plugin that does (disk: pip install -e plugins/kv_stores/disk)")
        raise ConfigError(
            f"inference.prefill_replicas / decode_replicas ({p} / {d}) hand each prompt's KV from a prefill server "
            f"to a decode server through the KV store, but inference.kv_store = {self.kv_store!r} (from {where}) "
            f"keeps KV inside each server's process: use {fix}")
