"""The ``embedded`` inference backend: build model + engine from a run config and serve it.

:class:`EmbeddedBackend` is a :class:`primerl.inference.InferenceBackend`: ``primerl
inference`` calls ``EmbeddedBackend().serve(cfg)``. The engine's KV store is the
``inference.kv_store`` plugin (default ``memory``), resolved through the registry.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from primerl.config import RunConfig
from primerl_embedded.config import EmbeddedConfig


class EmbeddedBackend:
    """Serves the selected model plugin with primerl's own engine (an ``InferenceBackend``)."""

    Config = EmbeddedConfig

    def build(self, cfg: RunConfig) -> tuple[Any, Any, Any]:
        """(engine, tokenizer, adapter) for ``cfg``; the engine is not started."""
        import attrs

        from primerl.registry import get_registry
        from primerl_embedded.engine import Engine

        adapter = get_registry().load("model", cfg.model.name)()
        model_cfg = cfg.model
        if cfg.inference.dtype:
            model_cfg = attrs.evolve(model_cfg, dtype=cfg.inference.dtype)
        model = adapter.build(model_cfg, device=cfg.inference.resolved_device())
        model.requires_grad_(False)  # served weights never train (not the caller's grad mode: a test builds in-process)
        if cfg.trainer.fp8:  # the trainer's block-scaled FP8 matmuls here too: both sides compute the same numbers
            from primerl.models.fp8_matmul import apply_fp8_matmuls_

            apply_fp8_matmuls_(model)
        tokenizer = adapter.tokenizer(model_cfg)
        layout = adapter.moe_layout(model_cfg)
        eos = tokenizer.eos_token_id
        from primerl.kv_stores import store_options

        # kv_store_options and what the launcher's run service set up for the store, if anything
        kv_store = get_registry().load("kv_store", cfg.inference.kv_store)(**store_options(cfg))
        engine = Engine(
            model,
            eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
            max_batch_size=cfg.inference.max_batch_size,
            max_model_len=cfg.inference.max_model_len,
            kv_slots=cfg.inference.kv_slots,
            num_experts=layout.get("num_experts"),
            kv_store=kv_store,
            max_waiting=cfg.inference.max_queue,
        )
        engine.decode = lambda ids: tokenizer.decode(ids)
        return engine, tokenizer, adapter

    @staticmethod
    def weight_loader(engine: Any, adapter: Any):
        """HF checkpoint directories go through the adapter (it knows the on-disk layout);
        a single safetensors file (the co-located /dev/shm channel) holds our own layout."""
        from pathlib import Path

        from primerl.weights import adopt, stage

        def load(path: str) -> Callable[[], Any]:
            """Prepare outside the step gap; return what must run inside it."""
            if Path(path).is_dir():
                return lambda: adapter.load_checkpoint(engine.model, path)
            # one safetensors file (/dev/shm): map and validate while the engine decodes,
            # then adopt the mapped tensors in the step gap (copies only where it must)
            pairs = stage(engine.model, path, writable=True)
            return lambda: adopt(pairs)

        return load

    def serve(self, cfg: RunConfig) -> None:
        import torch
        import uvicorn

        from primerl.inference import listening, server_socket
        from primerl_embedded.server import create_app

        sock = server_socket(cfg.inference)  # bound before the model is built
        torch.set_grad_enabled(False)  # this process only serves
        engine, tokenizer, adapter = self.build(cfg)
        engine.start()
        from primerl import watchdog

        watchdog.add_progress_source(lambda: engine.stats.prompt_tokens + engine.stats.generated_tokens)
        watchdog.doing("serving")
        app = create_app(engine, tokenizer, cfg.model.name, load_weights=self.weight_loader(engine, adapter),
                         api_key=cfg.inference.resolved_api_key())
        try:
            web = uvicorn.Server(uvicorn.Config(app, host=cfg.inference.host, port=cfg.inference.port,
                                                log_level="warning"))
            web.run(sockets=[listening(sock, cfg.inference)])
        finally:
            engine.stop()
