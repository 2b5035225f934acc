"""The primerl-contract server in front of vLLM: what the orchestrator talks to.

vLLM's OpenAI endpoints answer most of what RL needs, but not all of primerl's contract
(:mod:`primerl.serving.protocol`): no per-token policy versions, and weight updates are a sequence
of dev endpoints rather than one call. This thin server keeps the contract and lets vLLM
do the work:

* every generation goes to vLLM's token-in/token-out endpoint ``/inference/v1/generate``
  (prompts are tokenized, chats rendered, here, with the model's own tokenizer, so
  ``prompt_token_ids`` are exactly what the engine ran); each choice comes back with its
  ``token_ids``, logprobs by token id and ``weight_versions`` spans, which become
  ``policy_versions`` (one per token), and is shaped into OpenAI's completion or chat
  response with primerl's fields;
* ``POST /admin/weights`` pauses vLLM keeping in-flight requests (``/pause?mode=keep``),
  reloads the checkpoint in place (``/collective_rpc``: vLLM's ``reload_weights`` through
  :mod:`primerl_vllm.worker`, which also repacks CPU MoE weights), labels the
  engine's weights with the new version (``/update_weight_version``) and resumes;
* with ``trainer.weight_channel = "nccl"`` (GPUs), ``/admin/nccl/*`` forwards the trainer's
  NCCL weight transfer (:mod:`primerl_vllm.weight_transfer`) to vLLM's routes of the same
  names, inside the same pause / version / resume sequence, and ``/admin/weights`` with the
  trainer's marker directory confirms the version that arrived instead of reloading.

Versions are exact, not inferred from timing: vLLM's engine core attaches its current
weight-version label to the outputs of every step, and the label only changes while the
scheduler is paused, so a span says which weights computed each token, however late the
proxy reads it. New requests wait while an update runs, and every request carries the
version it starts under as its ``cache_salt``, so a request started after an update never
reuses prefix KV computed by older weights (requests already running keep theirs, as with
the embedded engine). docs/vllm.md states the guarantee.

Every endpoint is the one serving front's (:mod:`primerl.serving.front`): :class:`Proxy` is
its generator, so both backends accept and refuse the same bodies and answer in the same
shape; vLLM's own 4xx errors pass through in OpenAI's shape.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import json
import re
import time
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from primerl.serving import protocol as api
from primerl.serving.front import Generation, Refused, Sampling, error, prometheus
from primerl.serving.front import create_app as front_app
from primerl_vllm.weight_transfer import NCCL_MARKER, PREFIX

# vLLM's pause: requests in flight stay in the engine with their KV cache (clear_cache would
# preempt them and prefill them again under the new weights); new requests never reuse older
# weights' prefixes anyway (cache_salt)
KEEP = {"mode": "keep", "clear_cache": "false"}
# config.json keys that fix the shapes of a model's weights: an update must match the served model
SHAPE_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads",
              "num_key_value_heads", "head_dim", "intermediate_size", "moe_intermediate_size", "num_experts",
              "num_local_experts", "n_routed_experts", "num_experts_per_tok", "kv_lora_rank", "q_lora_rank",
              "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")


class NcclInitRequest(BaseModel):
    """``/admin/nccl/init_weight_transfer_engine``: vLLM's ``NCCLWeightTransferInitInfo`` fields."""

    model_config = ConfigDict(extra="forbid")
    init_info: dict[str, Any]


class NcclUpdateRequest(BaseModel):
    """``/admin/nccl/update_weights``: one chunk's names, dtype names and shapes (or a list, one per worker)."""

    model_config = ConfigDict(extra="forbid")
    update_info: dict[str, Any] | list[dict[str, Any]]


class NcclFinishRequest(BaseModel):
    """``/admin/nccl/finish_weight_update``: the policy version the new weights are."""

    model_config = ConfigDict(extra="forbid")
    weight_version: int


class UpstreamError(Exception):
    """vLLM refused a request (4xx) or failed (5xx); ``body`` is its answer."""

    def __init__(self, status: int, body: Any) -> None:
        super().__init__(f"{status}: {body}")
        self.status, self.body = status, body


def upstream_error(exc: UpstreamError) -> JSONResponse:
    return refused(exc).response()


def refused(exc: UpstreamError) -> Refused:
    """vLLM's refusal (or failure) as the front's: its own OpenAI-shaped error as it is."""
    body = exc.body
    if isinstance(body, dict) and isinstance(body.get("error"), dict):  # vLLM's OpenAI-shaped error
        e = body["error"]
        return Refused(exc.status, str(e.get("message")), e.get("param"), kind=e.get("type") or "invalid_request_error")
    message = body.get("detail") if isinstance(body, dict) else body
    status = exc.status if 400 <= exc.status < 500 else 502
    return Refused(status, f"vLLM: {message}", kind="invalid_request_error" if status < 500 else "upstream_error")


def expand_versions(spans: list[dict[str, Any]] | None, n: int, fallback: int) -> list[int]:
    """One policy version per token from vLLM's ``weight_versions`` spans ``[start, end)``.
    Tokens no span covers (vLLM reported no label) get ``fallback``: the version the request
    started under, the oldest weights that can have produced them."""
    out = [fallback] * n
    for span in spans or []:
        try:
            v = int(span["version"])
        except (TypeError, ValueError):
            continue  # a label primerl did not set ("default"): keep the fallback
        for i in range(max(0, span["start"]), min(n, span["end"])):
            out[i] = v
    return out


def routed_experts(b64_npy: str | None, moe_layers: list[int], num_layers: int, num_experts: int) -> api.RoutedExperts | None:
    """vLLM's routed experts (base64 ``.npy``, ``[tokens, layers, top_k]``) in primerl's layout:
    raw C-order bytes over the MoE layers only, uint8 up to 256 experts, else int16."""
    if not b64_npy:
        return None
    import numpy as np

    arr = np.load(io.BytesIO(base64.b64decode(b64_npy)), allow_pickle=False)
    if arr.ndim == 3 and arr.shape[1] == num_layers and len(moe_layers) != num_layers:
        arr = arr[:, moe_layers]  # vLLM wrote a row for every layer: keep the MoE ones
    arr = np.ascontiguousarray(arr.astype(np.uint8 if num_experts <= 256 else np.int16))
    return api.RoutedExperts(data=base64.b64encode(arr.tobytes()).decode(), shape=list(arr.shape),
                             dtype="uint8" if arr.dtype == np.uint8 else "int16", start=0)


def prometheus_value(text: str, name: str) -> float:
    """Sum of the samples of metric ``name`` in Prometheus text (0 when absent)."""
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([-+0-9.eE]+|NaN)$", text, re.M):
        try:
            total += float(m.group(1))
        except ValueError:
            pass
    return total


class Proxy:
    """One vLLM server as the serving front's :class:`~primerl.serving.front.Generator`: the
    front answers the endpoints, this turns them into vLLM calls (and the NCCL routes)."""

    serves_phases = False  # vLLM hands KV between servers with its own connectors

    def __init__(self, upstream: str, tokenizer: Any, model_name: str, *, max_model_len: int,
                 served_config: dict[str, Any], moe_layout: dict[str, Any], version: int = 0,
                 nccl: bool = False) -> None:
        self.upstream = upstream
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.served_config = served_config
        self.moe_layers = list(moe_layout.get("moe_layers") or [])
        self.num_experts = int(moe_layout.get("num_experts") or 0)
        self.num_layers = int(served_config.get("num_hidden_layers") or len(self.moe_layers))
        self.version = version
        self.paused = False  # by /admin/pause
        self.started = time.time()
        self.updates = 0
        self.last_update_seconds = 0.0
        self.answered = 0  # generations vLLM answered (the watchdog's progress)
        self.in_flight = 0  # sequences sent to vLLM and not finished
        self.nccl = nccl  # vLLM was started with --weight-transfer-config (trainer.weight_channel = "nccl")
        self.nccl_update: float | None = None  # perf_counter at start_weight_update while an NCCL update runs
        self._http: httpx.AsyncClient | None = None
        self._open: asyncio.Event | None = None  # cleared while weights are updated: new requests wait
        self._lock: asyncio.Lock | None = None

    # ---- plumbing -------------------------------------------------------------------------
    @property
    def http(self) -> httpx.AsyncClient:
        if self._http is None:
            self._http = httpx.AsyncClient(base_url=self.upstream, timeout=httpx.Timeout(None, connect=30.0),
                                           limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
        return self._http

    @property
    def open(self) -> asyncio.Event:
        if self._open is None:
            self._open = asyncio.Event()
            self._open.set()
        return self._open

    @property
    def lock(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()

    async def call(self, method: str, path: str, **kw: Any) -> Any:
        r = await self.http.request(method, path, **kw)
        if r.status_code >= 400:
            try:
                body = r.json()
            except ValueError:
                body = r.text[:2000]
            raise UpstreamError(r.status_code, body)
        if not r.content:
            return None
        try:
            return r.json()
        except ValueError:
            return r.text

    async def vllm_generate(self, prompt_ids: list[int], sampling: dict[str, Any], cache_salt: str | None = None,
                            priority: int = 0) -> tuple[dict[str, Any], int]:
        """One vLLM generation; (its response, the version the request started under). The
        prefix cache is salted by the policy version (and the request's own salt), so no
        request reuses KV of other weights (or of another salt)."""
        await self.open.wait()  # not while weights are being swapped: start under the new ones
        version = self.version
        salt = f"primerl-policy-v{version}"
        if cache_salt is not None:  # vLLM allows 128 characters, none of @ / \\ NUL: the salt's hash
            salt += "-" + hashlib.blake2b(cache_salt.encode(), digest_size=16).hexdigest()
        body = {"model": self.model_name, "token_ids": prompt_ids, "sampling_params": sampling,
                "output_mode": "tokens", "cache_salt": salt, "priority": priority}
        self.in_flight += sampling["n"]
        try:
            return await self.call("POST", api.GENERATE, json=body), version
        finally:
            self.in_flight -= sampling["n"]
            self.answered += 1

    @staticmethod
    def sampling(sampling: Sampling) -> dict[str, Any]:
        """vLLM SamplingParams of a request. For ``k`` alternatives vLLM is asked for ``k + 1``:
        its list starts with the sampled token, so k + 1 entries always hold the top k."""
        params: dict[str, Any] = {
            "n": sampling.n, "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
            "max_tokens": max(1, sampling.max_tokens), "ignore_eos": sampling.ignore_eos,
            "stop": list(sampling.stop), "stop_token_ids": list(sampling.stop_token_ids),
        }
        if sampling.seed is not None:
            params["seed"] = sampling.seed
        if sampling.logprobs is not None:
            params["logprobs"] = sampling.logprobs + 1 if sampling.logprobs else 0
        if sampling.prompt_logprobs is not None:
            params["prompt_logprobs"] = sampling.prompt_logprobs
        return params

    # ---- the front's generator --------------------------------------------------------------
    def check(self, prompt_ids: list[int], sampling: Sampling) -> None:
        pass  # vLLM validates; its 4xx comes back as the answer

    async def generate(self, prompt_ids: list[int], sampling: Sampling) -> list[Generation]:
        try:
            resp, version = await self.vllm_generate(prompt_ids, self.sampling(sampling), sampling.cache_salt,
                                                     sampling.priority)
        except UpstreamError as exc:
            raise refused(exc) from None
        k = sampling.logprobs or 0
        prompt = self.prompt_logprobs(prompt_ids, resp.get("prompt_logprobs"), sampling.prompt_logprobs or 0) \
            if sampling.prompt_logprobs is not None else (None, None)
        out = []
        for c in sorted(resp["choices"], key=lambda c: c["index"]):
            scored_only = sampling.max_tokens == 0  # echo-only: vLLM sampled one token, the prompt was scored
            ids = [] if scored_only else list(c["token_ids"])
            entries = [] if scored_only else ((c.get("logprobs") or {}).get("content") or [])
            stop = c.get("stop_reason")
            out.append(Generation(
                token_ids=ids, logprobs=[e["logprob"] for e in entries],
                policy_versions=expand_versions(c.get("weight_versions"), len(ids), version),
                finish_reason="length" if scored_only else c["finish_reason"],
                top_logprobs=[self.top_of(e, k) for e in entries], text=self.stopped_text(ids, stop),
                routed_experts=routed_experts(c.get("routed_experts"), self.moe_layers, self.num_layers,
                                              self.num_experts),
                prompt_logprobs=prompt[0], prompt_top_logprobs=prompt[1]))
        return out

    async def prefill(self, prompts: list[list[int]], sampling: Sampling) -> dict[str, Any]:
        raise Refused(400, "this backend serves no prefill/decode phases (vLLM's connectors hand KV over)")

    def stopped_text(self, ids: list[int], stop_reason: Any) -> str | None:
        """The text up to the stop string that ended it (vLLM keeps every token it sampled);
        None when no stop string did."""
        if not isinstance(stop_reason, str):
            return None
        full = self.tokenizer.decode(ids)
        cut = full.find(stop_reason)
        return full[:cut] if cut >= 0 else full

    @staticmethod
    def top_of(entry: dict[str, Any], k: int) -> dict[int, float]:
        """The ``k`` most likely tokens of one step, by vLLM's rank."""
        alts = [(a["token_id"], a["logprob"], a.get("rank") or 0) for a in entry.get("top_logprobs") or []]
        return {t: lp for t, lp, rank in sorted(alts, key=lambda x: x[2]) if 1 <= rank <= k}

    @staticmethod
    def prompt_logprobs(prompt_ids: list[int], given: list[Any] | None,
                        k: int) -> tuple[list[float | None], list[dict[int, float] | None]]:
        """vLLM's prompt logprobs (one dict per position, by token id; the first None) as the
        front's: the prompt token's logprob and its top ``k``."""
        lps: list[float | None] = []
        tops: list[dict[int, float] | None] = []
        for i, t in enumerate(prompt_ids):
            d = given[i] if given and i < len(given) else None
            if not d:
                lps.append(None)
                tops.append(None)
                continue
            scored = {int(key): v for key, v in d.items()}
            lps.append(scored[t]["logprob"] if t in scored else None)
            tops.append({tid: v["logprob"] for tid, v in scored.items() if 1 <= (v.get("rank") or 0) <= k})
        return lps, tops

    def health(self) -> api.Health:
        return api.Health(status="ok", policy_version=self.version, paused=self.paused)

    async def metrics(self) -> str:
        """vLLM's metrics, plus primerl's policy version and weight-update figures."""
        try:
            text = await self.call("GET", "/metrics")
        except (UpstreamError, httpx.HTTPError):
            text = ""
        return (text or "") + prometheus([
            ("primerl_policy_version", "gauge", "Version of the weights being served", self.version),
            ("primerl_weight_updates_total", "counter", "Weight updates applied", self.updates),
            ("primerl_weight_update_seconds", "gauge", "Duration of the last weight update", self.last_update_seconds),
        ])

    # ---- admin --------------------------------------------------------------------------------
    def check_update(self, path: str) -> str | None:
        """Why ``path`` cannot be loaded into the served model (None: it can). Checked before
        vLLM is touched, so a bad path changes nothing."""
        p = Path(path)
        if not p.exists():
            return f"weights path '{path}' does not exist"
        if not p.is_dir():
            return (f"'{path}' is a single file (the shm channel); the vllm backend reloads HF checkpoint "
                    "directories: set trainer.weight_channel = filesystem")
        cfg_file = p / "config.json"
        if not cfg_file.exists():
            return f"'{path}' has no config.json: not an HF checkpoint directory"
        try:
            hf = json.loads(cfg_file.read_text())
        except ValueError as exc:
            return f"'{cfg_file}' is not valid JSON: {exc}"
        if not any(p.glob("*.safetensors")):
            return f"'{path}' holds no .safetensors weights"
        for key in SHAPE_KEYS:
            if key in hf and key in self.served_config and hf[key] != self.served_config[key]:
                return (f"'{path}' is not the served model's shape: {key} is {hf[key]!r}, the served model has "
                        f"{self.served_config[key]!r}")
        return None

    async def update_weights(self, req: api.WeightUpdateRequest) -> Any:
        if Path(req.path).is_dir() and (Path(req.path) / NCCL_MARKER).exists():
            return await self.confirm_nccl(req)
        why = self.check_update(req.path)
        if why:
            raise Refused(400, why, "path")
        t0 = time.perf_counter()
        async with self.lock:
            version = req.version if req.version is not None else self.version + 1
            self.open.clear()  # requests arriving now start under the new weights
            try:
                await self.call("POST", "/pause", params=KEEP)
                try:
                    await self.call("POST", "/collective_rpc", json={  # vLLM's reload_weights, fixed (worker.py)
                        "method": "primerl_reload_weights", "kwargs": {"weights_path": str(Path(req.path).resolve())}})
                    await self.call("POST", "/update_weight_version", json={"new_version": str(version)})
                except UpstreamError as exc:
                    raise Refused(400, f"vLLM could not load weights from '{req.path}': {exc}; still serving "
                                       f"policy v{self.version} (weights may be partly replaced: load a good "
                                       "checkpoint)", "path") from None
                finally:
                    if not self.paused:
                        await self.call("POST", "/resume")
                self.version = version
            except (UpstreamError, httpx.HTTPError) as exc:
                raise Refused(500, f"weight update failed talking to vLLM: {exc}", kind="upstream_error") from None
            finally:
                self.open.set()
        self.updates += 1
        self.last_update_seconds = time.perf_counter() - t0
        return api.WeightUpdateResponse(policy_version=self.version, seconds=self.last_update_seconds)

    # ---- NCCL weight transfer (trainer.weight_channel = "nccl") -------------------------------
    def nccl_refused(self) -> JSONResponse | None:
        if self.nccl:
            return None
        return error(400, "this server was not started for NCCL weight transfer: run with --trainer.weight_channel "
                          "nccl (vLLM then starts with --weight-transfer-config), on CUDA GPUs")

    async def confirm_nccl(self, req: api.WeightUpdateRequest) -> Any:
        """``/admin/weights`` with the trainer's NCCL marker: the weights arrived over NCCL
        already (the trainer publishes the marker after its send finished); confirm them."""
        refused = self.nccl_refused()
        if refused is not None:
            return refused
        try:
            version = req.version if req.version is not None else int(
                json.loads((Path(req.path) / NCCL_MARKER).read_text())["version"])
        except (ValueError, KeyError, TypeError) as exc:
            raise Refused(400, f"'{req.path}/{NCCL_MARKER}' is not a valid NCCL marker: {exc}", "path") from None
        async with self.lock:  # after an update in progress, if any
            if self.version < version:
                raise Refused(409, f"policy v{version} was published over NCCL, but this server holds "
                                   f"v{self.version}: the trainer's NCCL send did not reach it", "path")
        return api.WeightUpdateResponse(policy_version=self.version, seconds=0.0)

    async def nccl_world_size(self) -> Any:
        """How many vLLM workers (TP x PP x DP) join the trainer's NCCL group."""
        refused = self.nccl_refused()
        if refused is not None:
            return refused
        body = await self.call("GET", "/get_world_size", params={"include_dp": "true"})
        return {"world_size": int(body["world_size"]), "policy_version": self.version}

    async def nccl_init(self, req: NcclInitRequest) -> Any:
        """vLLM's workers join the trainer's group (blocks until every rank has joined)."""
        refused = self.nccl_refused()
        if refused is not None:
            return refused
        return await self.call("POST", "/init_weight_transfer_engine", json={"init_info": req.init_info})

    async def nccl_shutdown(self) -> Any:
        refused = self.nccl_refused()
        if refused is not None:
            return refused
        return await self.call("POST", "/shutdown_weight_transfer_engine")

    async def _end_nccl_update(self) -> None:
        """Resume vLLM and let new requests in; the update lock is released."""
        try:
            if not self.paused:
                await self.call("POST", "/resume")
        finally:
            self.nccl_update = None
            self.open.set()
            self.lock.release()

    async def nccl_start(self) -> Any:
        """Hold new requests, pause vLLM keeping requests in flight, start its layerwise reload.
        The update lock stays held until ``finish_weight_update`` (or a failed chunk)."""
        refused = self.nccl_refused()
        if refused is not None:
            return refused
        await self.lock.acquire()
        self.open.clear()
        self.nccl_update = time.perf_counter()
        try:
            await self.call("POST", "/pause", params=KEEP)
            await self.call("POST", "/start_weight_update")
        except (UpstreamError, httpx.HTTPError) as exc:
            await self._end_nccl_update()
            return error(500, f"vLLM could not start an NCCL weight update: {exc}; still serving policy "
                              f"v{self.version}", kind="upstream_error")
        return {"status": "started", "policy_version": self.version}

    async def nccl_chunk(self, req: NcclUpdateRequest) -> Any:
        """One chunk: vLLM's workers receive it from the trainer's broadcast and load it."""
        refused = self.nccl_refused()
        if refused is not None:
            return refused
        if self.nccl_update is None:
            return error(409, f"no NCCL weight update in progress: POST {PREFIX}/start_weight_update first")
        try:
            await self.call("POST", "/update_weights", json={"update_info": req.update_info})
        except (UpstreamError, httpx.HTTPError) as exc:
            await self._end_nccl_update()
            return error(400, f"vLLM failed receiving weights over NCCL: {exc}; still serving policy v{self.version} "
                              "(weights may be partly replaced and the NCCL group unusable: restart the run)")
        return {"status": "received"}

    async def nccl_finish(self, req: NcclFinishRequest) -> Any:
        """Finish vLLM's reload, label its weights ``weight_version``, resume."""
        refused = self.nccl_refused()
        if refused is not None:
            return refused
        if self.nccl_update is None:
            return error(409, f"no NCCL weight update in progress: POST {PREFIX}/start_weight_update first")
        t0 = self.nccl_update
        try:
            await self.call("POST", "/finish_weight_update", json={"weight_version": str(req.weight_version)})
        except (UpstreamError, httpx.HTTPError) as exc:
            await self._end_nccl_update()
            return error(400, f"vLLM could not finish the NCCL weight update: {exc}; still serving policy "
                              f"v{self.version} (weights may be partly replaced)")
        self.version = req.weight_version  # before new requests are let in: they start under it
        await self._end_nccl_update()
        self.updates += 1
        self.last_update_seconds = time.perf_counter() - t0
        return api.WeightUpdateResponse(policy_version=self.version, seconds=self.last_update_seconds)

    async def pause(self) -> Any:
        async with self.lock:
            await self.call("POST", "/pause", params=KEEP)
            self.paused = True
        return api.PauseResponse(paused=True, policy_version=self.version)

    async def resume(self) -> Any:
        async with self.lock:
            await self.call("POST", "/resume")
            self.paused = False
        return api.PauseResponse(paused=False, policy_version=self.version)

    async def status(self) -> api.AdminStatus:
        try:  # vLLM's /metrics can take seconds under load: a status call must not
            text = await self.call("GET", "/metrics", timeout=1.0)
        except (UpstreamError, httpx.HTTPError):
            text = ""
        # vLLM's gauges can lag (they are not updated at all with --enforce-eager on CPU): the
        # proxy's own count of unfinished sequences bounds running + waiting from below
        waiting = int(prometheus_value(text, "vllm:num_requests_waiting"))
        running = max(int(prometheus_value(text, "vllm:num_requests_running")), self.in_flight - waiting)
        return api.AdminStatus(policy_version=self.version, paused=self.paused, running=running, waiting=waiting,
                               kv_usage=prometheus_value(text, "vllm:kv_cache_usage_perc"))


    def routes(self) -> list[tuple[str, str, Any]]:
        """The trainer's NCCL weight transfer (weight_transfer.py), named after vLLM's routes."""
        return [
            ("GET", f"{PREFIX}/world_size", self.nccl_world_size),
            ("POST", f"{PREFIX}/init_weight_transfer_engine", self.nccl_init),
            ("POST", f"{PREFIX}/start_weight_update", self.nccl_start),
            ("POST", f"{PREFIX}/update_weights", self.nccl_chunk),
            ("POST", f"{PREFIX}/finish_weight_update", self.nccl_finish),
            ("POST", f"{PREFIX}/shutdown_weight_transfer_engine", self.nccl_shutdown),
        ]


# ---- the app ------------------------------------------------------------------------------------


async def _upstream_down(_req: Request, exc: httpx.HTTPError) -> JSONResponse:
    return error(503, f"vLLM is not answering: {type(exc).__name__}: {exc}", kind="upstream_error")


async def _upstream(_req: Request, exc: UpstreamError) -> JSONResponse:
    return upstream_error(exc)


def create_app(proxy: Proxy, *, api_key: str | None = None) -> FastAPI:
    """The one serving front over ``proxy`` (:func:`primerl.serving.front.create_app`), with
    vLLM's failures answered in OpenAI's shape."""
    app = front_app(proxy, api_key=api_key, title="primerl vLLM inference")
    app.state.proxy = proxy
    app.add_exception_handler(httpx.HTTPError, _upstream_down)
    app.add_exception_handler(UpstreamError, _upstream)
    app.router.on_shutdown.append(proxy.close)
    return app
