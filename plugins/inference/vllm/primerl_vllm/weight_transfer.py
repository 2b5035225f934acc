"""Trainer side of vLLM's NCCL weight transfer (``trainer.weight_channel = "nccl"``).

With the ``filesystem`` channel the trainer writes an HF checkpoint every step and vLLM's
workers read it back; on GPUs that is a round trip through disk for weights that already
sit in GPU memory on both sides. vLLM 0.32 can receive weights over NCCL instead: the
server is started with ``--weight-transfer-config '{"backend": "nccl"}'`` and its dev
endpoints ``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``
and ``/finish_weight_update`` let a trainer join an NCCL group with the inference workers
and broadcast tensors to them (vllm/distributed/weight_transfer/nccl_engine.py).

:class:`NcclWeightSender` is that trainer: one process (global rank 0 of the trainer)
that

* :meth:`~NcclWeightSender.init`: asks each primerl proxy in front of vLLM how many
  workers it has (TP x PP x DP, ``GET /admin/nccl/world_size``), then joins them in one
  NCCL group of ``1 + sum(workers)`` ranks: the trainer is rank 0 and opens the
  rendezvous (a TCPStore on ``master_address:master_port``), each server's workers take
  the ranks after the previous server's (``rank_offset``), and the servers' init calls
  run concurrently with the trainer's, as the rendezvous needs;
* :meth:`~NcclWeightSender.send`: streams ``(HF name, tensor)`` pairs to every worker,
  chunk by chunk (``chunk_bytes``; the whole model is never held at once): for each chunk
  the proxies are told its names, dtypes and shapes (``update_weights``, which the workers
  answer by joining the broadcast) while the trainer broadcasts the chunk with vLLM's own
  packed producer, so both sides cut the stream identically. ``start_weight_update``
  before the first chunk pauses vLLM (in-flight requests kept, like a checkpoint reload)
  and starts vLLM's layerwise reload; ``finish_weight_update`` after the last one
  finishes it, labels the engine's weights with ``version`` and resumes: every token
  sampled afterwards reports ``version`` in its ``policy_versions``.

The proxies (``proxy.py``, ``/admin/nccl/*``) forward these calls to vLLM and keep
primerl's contract around them: new requests wait while an update runs, the proxy's
policy version follows the label, and ``POST /admin/weights`` with a directory holding
only :data:`NCCL_MARKER` (what the trainer publishes for this channel, so the orchestrator
sees ``weights/step_n/`` as usual) confirms that version ``n`` arrived instead of
reloading anything.

**Untested on GPUs.** This is written against vLLM 0.32's real API (``nccl_common``'s
rendezvous, ``packed_tensor``'s producer, the worker's chunked ``update_weights``); no
GPU was available where it was written, so only the refusals on CPU are tested
(``tests/inference/test_vllm_nccl.py``). Everything heavy (torch, vLLM) is imported
lazily: importing this module costs nothing, and on a machine without CUDA the sender
refuses at construction, in one line, naming the channel to use instead.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from primerl.errors import PrimerlError

# what the trainer publishes in weights/step_n/ for this channel: {"version": n}
NCCL_MARKER = "nccl.json"
# the proxy's endpoints for the trainer (each forwards to the vLLM route of the same name)
PREFIX = "/admin/nccl"
REFUSAL = ("trainer.weight_channel = 'nccl' needs CUDA GPUs on the trainer and on inference (NCCL): "
           "use --trainer.weight_channel filesystem")
INSTALL_GPU = 'pip install -e "plugins/inference/vllm[gpu]"'
DEFAULT_CHUNK_BYTES = 1 << 30  # tensors gathered before each update_weights round


def write_marker(directory: str | Path, version: int) -> Path:
    """Write :data:`NCCL_MARKER` for ``version`` into ``directory`` (the publish path's
    ``weights/step_n/``, written before its ``STABLE``)."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    (path / NCCL_MARKER).write_text(json.dumps({"version": int(version), "channel": "nccl"}) + "\n")
    return path / NCCL_MARKER


def _local_address_towards(url: str) -> str:
    """The address of this machine on the route to ``url``'s host: what vLLM's workers
    (on that host or its network) connect to for the rendezvous. Never what this machine's
    hostname resolves to (127.0.1.1 on a Debian node: no other node reaches it); no route
    is one line naming the URL."""
    host = urlparse(url).hostname or "127.0.0.1"
    try:
        family, _, _, _, where = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(where)  # UDP: picks the route, sends nothing
            return str(s.getsockname()[0])
    except OSError as exc:
        raise PrimerlError(f"trainer.weight_channel = 'nccl': this machine has no route to the inference server "
                           f"{url} ({exc}), so vLLM's workers cannot join the trainer's rendezvous: check the "
                           f"server's address in OUT/runtime.json, or use --trainer.weight_channel filesystem") from None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class NcclWeightSender:
    """Sends the trainer's weights to vLLM's workers over NCCL (see the module docstring).

    ``urls``: the primerl proxies in front of vLLM (``http://inference.host:inference.port``).
    ``dtype``: the dtype vLLM serves (``inference.dtype or model.dtype``); floating tensors
    are cast to it on the trainer's GPU before sending (half the bytes of fp32 master weights
    for bf16 serving), others are sent as they are. ``device``: the trainer's CUDA device
    (default: the current one). ``master_address``/``master_port``: the rendezvous (default:
    this machine's address towards the first proxy, a free port). ``chunk_bytes``: how many
    bytes of tensors are gathered per ``update_weights`` round; ``packed``,
    ``buffer_bytes``, ``num_buffers``: vLLM's packed broadcast (defaults: vLLM's, 1 GiB x 2).
    """

    def __init__(self, urls: str | Sequence[str], *, dtype: str | None = None, device: Any = None,
                 master_address: str | None = None, master_port: int = 0, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 packed: bool = True, buffer_bytes: int | None = None, num_buffers: int | None = None,
                 timeout_s: float = 900.0) -> None:
        import torch

        if not torch.cuda.is_available():  # first: the reason on every CPU machine
            raise PrimerlError(f"{REFUSAL} (torch.cuda.is_available() is False in the trainer)")
        try:
            from vllm.distributed.weight_transfer import packed_tensor
        except ImportError as exc:
            raise PrimerlError(f"trainer.weight_channel = 'nccl' needs vLLM's trainer-side helpers in the trainer's "
                               f"environment ({exc}): {INSTALL_GPU}") from None
        self.urls = [u.rstrip("/") for u in ([urls] if isinstance(urls, str) else urls)]
        if not self.urls:
            raise PrimerlError("NcclWeightSender needs the URL of at least one inference server")
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if self.device.type != "cuda":
            raise PrimerlError(f"{REFUSAL} (the sender was given device {self.device})")
        self.dtype = getattr(torch, dtype) if dtype else None
        self.master_address = master_address or _local_address_towards(self.urls[0])
        self.master_port = master_port
        self.chunk_bytes = max(1, int(chunk_bytes))
        self.packed = packed
        self.buffer_bytes = buffer_bytes or packed_tensor.DEFAULT_PACKED_BUFFER_SIZE_BYTES
        self.num_buffers = num_buffers or packed_tensor.DEFAULT_PACKED_NUM_BUFFERS
        self.timeout_s = timeout_s
        self.group: Any = None  # vLLM's PyNcclCommunicator, rank 0
        self.world_size = 0
        self.workers: list[int] = []  # per server
        self.broken: str | None = None  # why the group cannot be used any more
        self._pool = ThreadPoolExecutor(max_workers=max(2, len(self.urls)), thread_name_prefix="nccl-rpc")

    # ---- control plane: the proxies -------------------------------------------------------
    def _post(self, url: str, route: str, body: dict[str, Any] | None = None) -> Any:
        import httpx

        try:
            r = httpx.post(f"{url}{PREFIX}/{route}", json=body or {}, timeout=httpx.Timeout(None, connect=30.0))
        except httpx.HTTPError as exc:
            raise PrimerlError(f"NCCL weight transfer: {url} did not answer {PREFIX}/{route}: {exc}") from None
        if r.status_code >= 400:
            raise PrimerlError(f"NCCL weight transfer: {url}{PREFIX}/{route} answered {r.status_code}: {r.text[:500]}")
        return r.json() if r.content else None

    def _all(self, route: str, bodies: Sequence[dict[str, Any] | None]) -> list[Future]:
        return [self._pool.submit(self._post, url, route, body) for url, body in zip(self.urls, bodies, strict=True)]

    def _wait_ready(self, url: str) -> int:
        """Block until the proxy at ``url`` answers; the number of vLLM workers behind it."""
        import httpx

        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                r = httpx.get(f"{url}{PREFIX}/world_size", timeout=10)
                if r.status_code == 200:
                    return int(r.json()["world_size"])
                if r.status_code == 400:  # a server not started for NCCL: waiting will not help
                    raise PrimerlError(f"NCCL weight transfer: {url} refused: {r.text[:500]}")
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise PrimerlError(f"NCCL weight transfer: {url} did not answer {PREFIX}/world_size within "
                                   f"{self.timeout_s:.0f}s (is `primerl inference --inference.backend vllm` running?)")
            time.sleep(1.0)

    # ---- rendezvous --------------------------------------------------------------------------
    def init(self) -> NcclWeightSender:
        """Join one NCCL group with every vLLM worker behind ``urls``; returns ``self``."""
        import torch
        from vllm.distributed.weight_transfer.nccl_common import (
            NCCLWeightTransferInitInfo,
            worker_init_payload,
        )
        from vllm.distributed.weight_transfer.nccl_common import trainer_init as open_trainer_endpoint

        self.workers = [self._wait_ready(url) for url in self.urls]
        self.world_size = 1 + sum(self.workers)
        port = self.master_port or _free_port()
        payloads, offset = [], 1  # rank 0: this trainer; then each server's workers in turn
        for n in self.workers:
            payloads.append({"init_info": worker_init_payload(NCCLWeightTransferInitInfo(
                master_address=self.master_address, master_port=port, rank_offset=offset,
                world_size=self.world_size, packed=self.packed, packed_buffer_size_bytes=self.buffer_bytes,
                packed_num_buffers=self.num_buffers))})
            offset += n
        # the workers block in init until every rank has joined: their calls run beside ours
        futures = self._all("init_weight_transfer_engine", payloads)
        with torch.cuda.device(self.device):
            self.group = open_trainer_endpoint(
                {"master_address": self.master_address, "master_port": port, "world_size": self.world_size})
        for f in futures:
            f.result()
        return self

    # ---- data plane --------------------------------------------------------------------------
    def _prepare(self, tensor: Any) -> Any:
        import torch

        t = tensor.detach()
        full = getattr(t, "full_tensor", None)  # a DTensor handed over unsharded by mistake: gather it
        if callable(full):
            t = full()
        dtype = self.dtype if self.dtype is not None and torch.is_floating_point(t) else t.dtype
        return t.to(device=self.device, dtype=dtype, non_blocking=True).contiguous()

    def _broadcast(self, chunk: list[tuple[str, Any]]) -> None:
        """One update_weights round: the proxies get the chunk's metadata (their workers join
        the broadcast) while the chunk goes out from rank 0."""
        import torch
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        info = {"update_info": {"names": [n for n, _ in chunk],
                                "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in chunk],
                                "shapes": [list(t.shape) for _, t in chunk]}}
        futures = self._all("update_weights", [info] * len(self.urls))
        for f in futures:  # a request refused before any NCCL call: fail now, not in the broadcast
            if f.done():
                f.result()
        if self.packed:
            packed_nccl_broadcast_producer(iterator=iter(chunk), group=self.group, src=0,
                                           post_iter_func=lambda item: item[1], buffer_size_bytes=self.buffer_bytes,
                                           num_buffers=self.num_buffers)
        else:
            stream = torch.cuda.current_stream()
            for _name, t in chunk:
                self.group.broadcast(t, src=0, stream=stream)
        for f in futures:
            f.result()

    def send(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> dict[str, Any]:
        """Send ``(HF name, tensor)`` pairs (every tensor of the model, in any order) to vLLM
        and make ``version`` the served policy version; returns what was sent.

        The iterable is consumed once, chunk by chunk: a sharded trainer can gather one unit
        at a time (``parallelism.full_weights``) and nothing holds the whole model. A failure
        in the middle leaves vLLM's weights partly replaced and the NCCL group unusable (a
        worker may still be waiting in the broadcast): restart the run.
        """
        import torch

        if self.group is None:
            raise PrimerlError("NcclWeightSender.send before init(): call init() once, after the servers start")
        if self.broken:
            raise PrimerlError(f"NCCL weight transfer is unusable since an earlier failure ({self.broken}): "
                               "restart the run")
        t0 = time.perf_counter()
        tensors = nbytes = chunks = 0
        try:
            for f in self._all("start_weight_update", [None] * len(self.urls)):
                f.result()
            with torch.cuda.device(self.device):
                chunk: list[tuple[str, Any]] = []
                size = 0
                for name, tensor in named_tensors:
                    t = self._prepare(tensor)
                    chunk.append((name, t))
                    size += t.numel() * t.element_size()
                    if size >= self.chunk_bytes:
                        self._broadcast(chunk)
                        tensors, nbytes, chunks = tensors + len(chunk), nbytes + size, chunks + 1
                        chunk, size = [], 0
                if chunk:
                    self._broadcast(chunk)
                    tensors, nbytes, chunks = tensors + len(chunk), nbytes + size, chunks + 1
                torch.cuda.current_stream().synchronize()
        except BaseException as exc:
            self.broken = f"{type(exc).__name__}: {exc}"
            raise
        for f in self._all("finish_weight_update", [{"weight_version": int(version)}] * len(self.urls)):
            f.result()
        return {"version": int(version), "tensors": tensors, "bytes": nbytes, "chunks": chunks,
                "seconds": time.perf_counter() - t0}

    def mark(self, directory: Path, version: int) -> None:
        """The ``weights/step_n`` marker the proxy's ``/admin/weights`` expects (:func:`write_marker`)."""
        write_marker(directory, version)

    def close(self) -> None:
        """Leave the group: vLLM's workers release their side, then ours is destroyed."""
        if self.group is not None:
            for f in self._all("shutdown_weight_transfer_engine", [None] * len(self.urls)):
                try:
                    f.result()
                except PrimerlError:
                    pass  # a server already gone
            self.group.destroy()
            self.group = None
        self._pool.shutdown(wait=False)

    def __enter__(self) -> NcclWeightSender:
        return self.init()

    def __exit__(self, *_exc: Any) -> None:
        self.close()
