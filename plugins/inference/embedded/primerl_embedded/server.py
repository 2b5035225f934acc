"""The embedded engine behind the one serving front (:mod:`primerl.serving.front`).

The front answers every endpoint (the OpenAI API, vLLM's token routes, ``/tokenize``,
``/health``, ``/metrics``, the admin endpoints) and shapes every response; this module is
the engine's side of it, :class:`EngineGenerator`: a request's prompt ids and sampling
become the engine's sequences (submitted to the engine thread and awaited), and its
sequences become :class:`~primerl.serving.front.Generation` records (tokens, sampling
logprobs, per-token policy versions, routed experts). Handlers never touch the model.

``/v1/completions`` with ``echo: true`` gets the prompt's log-probabilities from the engine
(a logprob for every prompt token after the first, from the same forward and the same
function as sampled tokens); ``max_tokens: 0`` then scores the prompt alone. That is what
lm-evaluation-harness's loglikelihood (multiple-choice) tasks send.

Prefill/decode disaggregation (vLLM's ``kv_transfer_params``): the prefill phase runs the
prompts, samples nothing and writes their KV blocks (with their routed experts) to the KV
store every server shares, answering the decode phase's params
(:meth:`EngineGenerator.prefill`); the decode phase's prompt KV comes from the store (409
``kv_missing`` when it is gone: prefill again). ``POST /admin/weights`` takes an HF
safetensors checkpoint directory, or one safetensors file in /dev/shm (the co-located
channel), staged while the engine decodes and copied in between two of its steps.
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from primerl.serving import protocol as api
from primerl.serving.front import Generation, Refused, Sampling, prometheus
from primerl.serving.front import create_app as front_app
from primerl.serving.protocol import WeightUpdateRequest
from primerl_embedded.engine import Engine, Phase, QueueFull, RequestError, SamplingParams, Sequence
from primerl_embedded.pd import KV_MISSING, KVHandoff


class EngineGenerator:
    """The embedded engine as the front's :class:`~primerl.serving.front.Generator`.

    ``load_weights(path)`` prepares a checkpoint (outside the engine's step gap) and returns
    a callable that copies it into the served model (run by the engine between steps).
    """

    serves_phases = True

    def __init__(self, engine: Engine, tokenizer: Any, model_name: str,
                 load_weights: Callable[[str], Callable[[], Any]] | None = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = engine.max_model_len
        self.load_weights = load_weights or self._stage_and_adopt
        self.handoff = KVHandoff(engine.kv_store)  # prefill/decode disaggregation's phases (primerl_embedded.pd)

    def _stage_and_adopt(self, path: str) -> Callable[[], Any]:
        from primerl.weights import adopt, stage

        pairs = stage(self.engine.model, path, writable=True)
        return lambda: adopt(pairs)

    # ---- generation -----------------------------------------------------------------------
    @staticmethod
    def params(sampling: Sampling) -> SamplingParams:
        return SamplingParams(
            max_tokens=sampling.max_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
            top_k=sampling.top_k, seed=sampling.seed, n=sampling.n, stop=list(sampling.stop),
            stop_token_ids=list(sampling.stop_token_ids), ignore_eos=sampling.ignore_eos, logprobs=sampling.logprobs,
            prompt_logprobs=sampling.prompt_logprobs, return_routed_experts=sampling.return_routed_experts,
            cache_salt=sampling.cache_salt, priority=sampling.priority,
        )

    def check(self, prompt_ids: list[int], sampling: Sampling) -> None:
        try:
            self.engine.validate(prompt_ids, self.params(sampling))  # a phase's own rules: in submit
        except RequestError as exc:
            raise Refused(400, str(exc)) from None

    async def run(self, prompt_ids: list[int], params: SamplingParams, phase: Phase | None = None) -> list[Sequence]:
        """Submit one prompt's ``params.n`` sequences and wait for all of them; a cancelled
        request (the client went away, the server is stopping) aborts them."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        remaining = [params.n]

        def done(_seq: Sequence) -> None:
            remaining[0] -= 1
            if remaining[0] == 0:
                loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(None))

        try:
            seqs = self.engine.submit(prompt_ids, params, on_done=done, phase=phase)
        except QueueFull as exc:  # 503 with Retry-After: the server keeps serving what it holds
            raise Refused(503, str(exc), kind="server_busy", headers={"Retry-After": "1"}) from None
        except RequestError as exc:
            raise Refused(400, str(exc)) from None
        try:
            await fut
        except asyncio.CancelledError:
            self.engine.abort(seqs)
            raise
        return seqs

    async def generate(self, prompt_ids: list[int], sampling: Sampling) -> list[Generation]:
        try:
            phase = self.handoff.phase(sampling.phase) if sampling.phase is not None else None
        except RequestError as exc:
            raise Refused(400, str(exc)) from None
        seqs = await self.run(prompt_ids, self.params(sampling), phase)
        if any(s.unplaced for s in seqs):
            raise Refused(409, "the prompt's KV blocks are not in the KV store (evicted, their server left the pool, "
                               "or the weights changed since the prefill): run the prefill phase again",
                          "kv_transfer_params", kind=KV_MISSING)
        return [self.generation(s) for s in seqs]

    def generation(self, seq: Sequence) -> Generation:
        routed = None
        if seq.params.return_routed_experts:
            experts = seq.routed_experts()
            if experts is not None:  # vLLM's layout: data first, rows from token `start` of the prompt
                routed = api.RoutedExperts(
                    data=base64.b64encode(experts.contiguous().numpy().tobytes()).decode(),
                    shape=list(experts.shape), dtype=str(experts.dtype).replace("torch.", ""), start=0)
        text = self.tokenizer.decode(seq.output_ids)[: seq.stop_text_at] if seq.stop_text_at is not None else None
        return Generation(token_ids=seq.output_ids, logprobs=seq.logprobs, policy_versions=seq.versions,
                          finish_reason=seq.finish_reason, top_logprobs=seq.top_logprobs, text=text,
                          routed_experts=routed, prompt_logprobs=seq.prompt_logprobs,
                          prompt_top_logprobs=seq.prompt_top_logprobs)

    async def prefill(self, prompts: list[list[int]], sampling: Sampling) -> api.PrefillResponse:
        """P/D's prefill phase: run every prompt, sample nothing, and write its KV blocks (with
        their routed experts) to the KV store every server shares; answer what the decode
        server needs, as ``kv_transfer_params`` to send along with the same request."""
        phases = [self.handoff.phase("prefill") for _ in prompts]
        results = await asyncio.gather(*(self.run(ids, SamplingParams(max_tokens=0), phase)
                                         for ids, phase in zip(prompts, phases)))
        n = sum(len(i) for i in prompts)
        return api.PrefillResponse(
            id=f"prefill-{uuid.uuid4().hex}", object="primerl.prefill", created=int(time.time()),
            model=self.model_name, usage=api.Usage(prompt_tokens=n, completion_tokens=0, total_tokens=n),
            kv_transfer_params=api.PrefillTransfer(
                do_remote_prefill=True, block_size=self.handoff.block_size,
                # per prompt: its ids, the full blocks the store holds, the weights that computed them
                prompts=[api.PrefilledPrompt(prompt_token_ids=ids, blocks=phase.blocks,
                                             policy_version=seqs[0].kv_version)
                         for ids, phase, seqs in zip(prompts, phases, results)]))

    # ---- health, metrics, admin -------------------------------------------------------------
    def health(self) -> api.Health:
        return api.Health(status="ok", policy_version=self.engine.version, paused=self.engine.paused)

    async def status(self) -> api.AdminStatus:
        e = self.engine
        return api.AdminStatus(policy_version=e.version, paused=e.paused, running=len(e.running),
                               waiting=len(e.waiting), kv_usage=e.kv_usage())

    async def metrics(self) -> str:
        s, engine = self.engine.stats, self.engine
        return prometheus([
            ("primerl_requests_total", "counter", "Requests received", s.requests),
            ("primerl_prompt_tokens_total", "counter", "Prompt tokens processed", s.prompt_tokens),
            ("primerl_generation_tokens_total", "counter", "Tokens generated", s.generated_tokens),
            ("primerl_prefix_cache_hit_tokens_total", "counter", "Prompt tokens served from the prefix cache", s.prefix_hit_tokens),
            ("primerl_engine_steps_total", "counter", "Scheduler steps", s.steps),
            ("primerl_batch_size", "gauge", "Sequences in the running batch", s.last_batch_size),
            ("primerl_waiting_sequences", "gauge", "Sequences waiting for a slot", len(engine.waiting)),
            ("primerl_kv_cache_usage", "gauge", "Share of KV slots held by running sequences", engine.kv_usage()),
            ("primerl_policy_version", "gauge", "Version of the weights being served", engine.version),
            ("primerl_weight_updates_total", "counter", "Weight updates applied", s.weight_updates),
            ("primerl_weight_update_seconds", "gauge", "Duration of the last weight copy", s.last_update_seconds),
        ])

    async def update_weights(self, req: WeightUpdateRequest) -> api.WeightUpdateResponse:
        from primerl.weights import WeightsError

        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        try:
            # load_into checks names and shapes before touching a parameter: a bad checkpoint changes nothing
            if not Path(req.path).exists():
                raise WeightsError(f"weights path '{req.path}' does not exist")
            # stage (map, validate) while the engine keeps decoding, then copy in its step gap
            copy_in = await loop.run_in_executor(None, self.load_weights, req.path)
            version = await loop.run_in_executor(None, lambda: self.engine.update_weights(copy_in, req.version))
        except WeightsError as exc:
            raise Refused(400, str(exc), "path") from None
        except Exception as exc:  # noqa: BLE001 - report, keep serving the old weights
            raise Refused(400, f"could not load weights from '{req.path}': {type(exc).__name__}: {exc}",
                          "path") from None
        return api.WeightUpdateResponse(policy_version=version, seconds=time.perf_counter() - t0)

    async def pause(self) -> api.PauseResponse:
        self.engine.pause()
        return api.PauseResponse(paused=True, policy_version=self.engine.version)

    async def resume(self) -> api.PauseResponse:
        self.engine.resume()
        return api.PauseResponse(paused=False, policy_version=self.engine.version)

    def routes(self) -> list[tuple[str, str, Callable[..., Any]]]:
        return []


def create_app(engine: Engine, tokenizer: Any, model_name: str,
               load_weights: Callable[[str], Any] | None = None, *, api_key: str | None = None) -> FastAPI:
    """The one serving front over the engine (:func:`primerl.serving.front.create_app`)."""
    return front_app(EngineGenerator(engine, tokenizer, model_name, load_weights), api_key=api_key,
                     title="primerl embedded inference")
