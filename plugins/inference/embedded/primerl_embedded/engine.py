"""The embedded inference engine: continuous batching over a slot KV cache.

Why our own engine: RL needs things a plain ``generate`` loop lacks — requests joining
and leaving the running batch at every step (a long rollout never holds up short ones),
the token ids and per-token log-probabilities of everything it produced, the policy
version of every token, the routed experts of every token (router replay), and weight
updates that land between two decode steps without aborting anything in flight. And it
must run wherever torch runs, a laptop CPU included.

How it works. One thread owns the model and loops over :meth:`Engine.step`:

1. apply a pending weight update, if any (between steps, so in-flight sequences carry
   on with the new weights; each later token records the new version);
2. admit waiting sequences into free KV slots, reusing the longest cached prefix the KV
   store holds (a multi-turn episode's earlier turns) or a sibling's prompt (``n > 1``:
   siblings wait one step for their leader's prompt; the sequences behind them go ahead);
3. run one forward for the decode rows (one new token each) and one or a few for the
   prefill rows (a prompt's uncached tokens; prompts of very different lengths are split
   by length, which pads less: :func:`prefill_groups`), all ragged via per-row lengths
   and past lengths;
4. sample a token per row (temperature, top-k, top-p, per-request seed), record its
   log-probability, version and routed experts, and retire finished sequences, whose
   slots go to the KV store (:class:`primerl.kv_stores.KVStore`, the ``inference.kv_store``
   plugin; ``memory`` keeps them in place for prefix reuse until the slot is needed).

A request that asks for its prompt's log-probabilities (``echo`` with ``logprobs``, as
lm-evaluation-harness scores multiple choice) is prefilled from scratch in a forward of its
own that returns the logits of every position; ``max_tokens=0`` then generates nothing.

A sequence may bring rules of its own for where its prompt KV comes from and where it goes
(a :class:`Phase`): prefill/decode disaggregation's phases (:mod:`primerl_embedded.pd`) wrap
the engine this way, and the scheduler below knows nothing of them.

Slots stay compact: the i-th running sequence holds slot i (a sequence that finishes
swaps slots with the last running one; a new one takes the first slot after them), so
every forward's slots are consecutive and the model reads the cache in place instead of
gathering every row's keys at every step (vLLM's persistent batch condenses the same
way). Idle cached prefixes and free slots live above the running ones: the KV store moves
an idle prefix out of a slot the running batch needs (:meth:`KVStore.vacate`).

The model contract (:class:`primerl.models.contract.CausalLM`, ``docs/models.md``):
``model(input_ids [B,S], positions [B,S], lengths [B], cache=, slots=, past_lens=,
logits_for="last")`` returning ``.logits [B,V]``
(``[B,S,V]`` with ``logits_for="all"``, which only prompt scoring asks for) and
``.routed_experts [B,S,L,k]`` (or None for dense models), and
``model.new_cache(num_slots, max_len)`` with ``copy_prefix(src, dst, n)`` (skipped when
the cache says ``supports_prefix_reuse = False``: recurrent layers such as Mamba keep a
state only at a slot's full length); prompt token ids are checked against ``model.vocab_size``.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

import attrs
import torch

from primerl.errors import PrimerlError
from primerl.kv_stores import KVStore, PrefixHit, SlotPool
from primerl.models.contract import CausalLM
from primerl.sampling import sample, scale


def model_identity(model: torch.nn.Module) -> str:
    """A name for the weights a model starts from, the same in every server of a run (the
    :class:`~primerl.kv_stores.SlotPool`'s ``model``, which block keys carry):
    the class and a hash of its parameter count, first parameter's dtype and first values.

    Two processes that build the same preset with the same seed, or load the same
    checkpoint, get the same name (their blocks are shared); a different seed, checkpoint,
    architecture or dtype gets another. Later weights are told apart by the version
    (:attr:`primerl.kv_stores.SlotPool.version`), so this is computed once, at engine start.
    """
    params = list(model.parameters())
    h = hashlib.blake2b(type(model).__qualname__.encode(), digest_size=8)
    h.update(str(sum(p.numel() for p in params)).encode())
    if params:
        first = params[0].detach().reshape(-1)[:256].float().cpu()
        h.update(str(params[0].dtype).encode())
        h.update(first.numpy().tobytes())
    return f"{type(model).__name__}-{h.hexdigest()}"


class RequestError(PrimerlError):
    """A request the engine cannot serve (too long, bad parameters): a 4xx for the client."""


class QueueFull(RequestError):
    """The waiting queue is at ``max_waiting`` sequences: a 503 for the client, who may retry;
    what the engine already holds keeps running and memory stays bounded."""


@attrs.define(kw_only=True)
class SamplingParams:
    max_tokens: int = 16  # 0: prefill only (the prompt is scored when prompt_logprobs is set)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    n: int = 1
    stop: list[str] = attrs.Factory(list)
    stop_token_ids: list[int] = attrs.Factory(list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: sampled token only; k: also the top-k alternatives
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (echo)
    return_routed_experts: bool = False
    cache_salt: str | None = None  # cached prefixes are shared only by requests of the same salt
    priority: int = 0  # lower is admitted first; equal priorities in arrival order


def salted_key(tokens: list[int], salt: str | None) -> list[int]:
    """The tokens a KV store keys a sequence's prefix by: its own, the first one replaced
    under a ``cache_salt`` by a number no vocabulary holds (2**31 and up, from the salt's
    hash; block stores pack tokens as uint32), so a salted prefix matches only the same salt's, in every store (slot-resident
    or blocks) and without a store knowing salts."""
    if salt is None or not tokens:
        return tokens
    mark = int.from_bytes(hashlib.blake2b(salt.encode(), digest_size=4).digest(), "little") | (1 << 31)
    return [mark ^ tokens[0], *tokens[1:]]


class Phase(Protocol):
    """Rules a sequence brings for its prompt KV, beyond the scheduler's own (prefill/decode
    disaggregation's two phases are the ones there are: :mod:`primerl_embedded.pd`)."""

    unplaced_reason: str  # the finish_reason of a sequence whose prompt KV was not found

    def check(self, params: SamplingParams, prefix_reuse: bool) -> None:
        """Refuse, as a :class:`RequestError`, a request this phase cannot serve."""

    def must_find(self, prompt_len: int) -> int:
        """Prompt tokens the sequence must find cached (in the KV store) to be placed; with
        fewer it finishes unplaced, never run."""

    def retired(self, seq: Sequence, current: bool) -> None:
        """``seq`` finished; its KV is still in ``seq.slot`` (of the current weights if ``current``)."""


@attrs.define(eq=False)
class Sequence:
    """One sampled continuation of a prompt, and everything recorded while producing it."""

    id: int
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    output_ids: list[int] = attrs.Factory(list)
    logprobs: list[float] = attrs.Factory(list)
    top_logprobs: list[dict[int, float]] = attrs.Factory(list)
    # with params.prompt_logprobs: one per prompt token, None for the first (nothing predicts it)
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[dict[int, float] | None] | None = None
    versions: list[int] = attrs.Factory(list)  # policy version that produced each output token
    routed: list[torch.Tensor] = attrs.Factory(list)  # chunks [n_tokens, L, k] in token order
    finish_reason: str | None = None
    stop_text_at: int | None = None  # where a stop string begins in the decoded text
    slot: int = -1
    cached: int = 0  # tokens of (prompt + output) already in the KV cache
    kv_version: int = 0  # policy version of the oldest KV in its slot (older than the engine's: ran across an update)
    leader: Sequence | None = None  # for n > 1: the sibling whose prompt KV this one copies
    arrival: float = attrs.Factory(time.monotonic)
    on_done: Callable[[Sequence], None] | None = None
    phase: Phase | None = None  # its own rules for its prompt KV (prefill/decode's phases)
    unplaced: bool = False  # its phase's prompt KV was not found: finished without running

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def scores_prompt(self) -> bool:
        """Whether this sequence computes its prompt's logprobs (a sibling shares its leader's)."""
        return self.params.prompt_logprobs is not None and self.leader is None

    def cache_key(self, n: int | None = None) -> list[int]:
        """The KV store's key of the first ``n`` tokens (all by default): :func:`salted_key`."""
        return salted_key(self.tokens if n is None else self.tokens[:n], self.params.cache_salt)

    def routed_experts(self) -> torch.Tensor | None:
        """[tokens processed, L, k] routed expert ids (uint8, or int16 above 255 experts)."""
        return torch.cat(self.routed) if self.routed else None


@attrs.define
class EngineStats:
    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefix_hit_tokens: int = 0
    steps: int = 0
    weight_updates: int = 0
    last_update_seconds: float = 0.0
    last_batch_size: int = 0


class Engine:
    def __init__(
        self,
        model: CausalLM,
        *,
        eos_token_ids: list[int],
        max_batch_size: int = 64,
        max_model_len: int = 1024,
        kv_slots: int = 128,
        max_prefill_tokens: int = 4096,
        num_experts: int | None = None,
        kv_store: KVStore | None = None,
        max_waiting: int = 4096,
    ):
        """``kv_store``: where finished sequences' KV goes for prefix reuse (None: the registry's
        ``memory`` store, the ``inference.kv_store`` default). ``max_waiting``: sequences that
        may wait for a slot; beyond it :meth:`submit` raises :class:`QueueFull`."""
        if kv_slots < max_batch_size:
            raise ValueError(f"kv_slots ({kv_slots}) must be >= max_batch_size ({max_batch_size})")
        self.model = model.eval()
        self.eos = set(eos_token_ids)
        self.max_batch_size = max_batch_size
        self.max_model_len = max_model_len
        self.max_prefill_tokens = max_prefill_tokens
        self.max_waiting = max_waiting
        # what one more forward costs, in padded token positions: prefill rows of very
        # different lengths run as several forwards when that pads less (prefill_groups)
        self.prefill_group_cost = 256
        self.routed_dtype = torch.uint8 if (num_experts or 0) <= 256 else torch.int16
        self.param = next(model.parameters())
        self.cache = model.new_cache(kv_slots, max_model_len)
        self.kv_slots = kv_slots
        self.slots = SlotPool(self.cache, kv_slots, model=model_identity(model))  # block keys' namespace
        if kv_store is None:
            from primerl.registry import get_registry

            kv_store = get_registry().load("kv_store", "memory")()
        self.kv_store: KVStore = kv_store
        self.kv_store.bind(self.slots)
        # a store that publishes KV under the current version's keys never gets KV of two policies
        self._current_kv_only = kv_store.current_weights_only
        # recurrent layers (Mamba) keep a state only at a slot's full length: no prefix to reuse
        self.prefix_reuse = self.cache.supports_prefix_reuse
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.version = 0
        self.stats = EngineStats()
        self._ids = itertools.count()
        self._lock = threading.Condition()
        self._updates: deque[tuple[Callable[[], None], int, threading.Event, list]] = deque()
        self._aborts: deque[Sequence] = deque()
        self._paused = False
        self._stop = False
        self._thread: threading.Thread | None = None

    # ---- public API (thread-safe) ---------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams,
               on_done: Callable[[Sequence], None] | None = None, *, phase: Phase | None = None) -> list[Sequence]:
        """Queue ``params.n`` sequences for a prompt; ``on_done`` fires in the engine thread.
        ``phase``: the rules its prompt KV follows (:class:`Phase`), checked here."""
        self.validate(prompt_ids, params)
        if phase is not None:
            phase.check(params, self.prefix_reuse)
        seqs = []
        for i in range(params.n):
            gen = None
            if params.seed is not None:
                gen = torch.Generator().manual_seed(params.seed + i)
            seq = Sequence(id=next(self._ids), prompt_ids=list(prompt_ids), params=params,
                           generator=gen, on_done=on_done, phase=phase)
            if i > 0:
                seq.leader = seqs[0]
            seqs.append(seq)
        with self._lock:
            if len(self.waiting) + len(seqs) > self.max_waiting:
                raise QueueFull(f"the server's queue is full ({len(self.waiting)} sequences waiting, at most "
                                f"{self.max_waiting}: inference.max_queue): retry later")
            if self.waiting and self.waiting[-1].params.priority > params.priority:
                at = next(i for i, w in enumerate(self.waiting) if w.params.priority > params.priority)
                for k, seq in enumerate(seqs):  # before the first of a later priority, after its equals
                    self.waiting.insert(at + k, seq)
            else:
                self.waiting.extend(seqs)
            self.stats.requests += 1
            self._lock.notify_all()
        return seqs

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        vocab = self.model.vocab_size
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        if any(t < 0 or t >= vocab for t in prompt_ids):
            raise RequestError(f"prompt token ids must be in [0, {vocab})")
        if params.max_tokens < 0:
            raise RequestError("max_tokens must be >= 0")
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise RequestError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"maximum model length {self.max_model_len}; shorten the prompt or lower max_tokens"
            )
        if params.n < 1 or params.n > self.max_batch_size:
            raise RequestError(f"n must be in [1, {self.max_batch_size}]")
        if params.temperature < 0:
            raise RequestError("temperature must be >= 0")
        if not 0 < params.top_p <= 1:
            raise RequestError("top_p must be in (0, 1]")
        if params.logprobs is not None and not 0 <= params.logprobs <= 20:
            raise RequestError("logprobs must be between 0 and 20")
        if params.prompt_logprobs is not None and not 0 <= params.prompt_logprobs <= 20:
            raise RequestError("prompt logprobs must be between 0 and 20")

    def update_weights(self, apply: Callable[[], object], version: int | None = None, wait: bool = True) -> int:
        """Run ``apply`` (which puts new weights into the model) between two steps. What it
        returns is dropped here, in the calling thread, after the engine has resumed: an
        adoption (:func:`primerl.weights.adopt`) returns the tensors it replaced, so freeing
        the old weights is no part of the step gap."""
        done = threading.Event()
        out: dict[str, object] = {}  # "error" or "result", set by the thread that applies
        with self._lock:
            new_version = version if version is not None else self.version + 1
            self._updates.append((apply, new_version, done, out))
            self._lock.notify_all()
        if not self.running_in_thread():
            self._apply_updates()
        elif wait:
            done.wait()
        if "error" in out:
            raise out["error"]
        out.clear()  # apply's result (an adoption's old weights) freed in this thread
        return new_version

    def abort(self, seqs: list[Sequence]) -> None:
        """Stop generating for these sequences (the client went away); frees their slots."""
        with self._lock:
            self._aborts.extend(s for s in seqs if s.finish_reason is None)
            self._lock.notify_all()

    def _apply_aborts(self) -> None:
        with self._lock:
            while self._aborts:
                s = self._aborts.popleft()
                if s.finish_reason is not None:
                    continue
                s.finish_reason = "abort"
                if s in self.waiting:
                    self.waiting.remove(s)
                elif s in self.running:
                    self._retire(s, keep_prefix=False)

    def pause(self) -> None:
        with self._lock:
            self._paused = True

    def resume(self) -> None:
        with self._lock:
            self._paused = False
            self._lock.notify_all()

    @property
    def paused(self) -> bool:
        return self._paused

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="primerl-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        if self._thread:
            self._thread.join(timeout=10)

    def running_in_thread(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def free_slots(self) -> set[int]:
        """Slots holding nothing (neither a running sequence nor the KV store's idle prefixes)."""
        return self.slots.free

    def reset_prefix_cache(self) -> None:
        """Forget every idle cached prefix (call between steps, as weight updates do)."""
        self.kv_store.clear()

    def kv_usage(self) -> float:
        """Share of KV slots held by running sequences (idle cached prefixes count as free)."""
        busy = self.kv_slots - len(self.slots.free) - len(self.kv_store.slots())
        return busy / self.kv_slots

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> list[Sequence]:
        """Synchronous helper (tests, benchmarks): wait for (or drive) this request to the end."""
        seqs = self.submit(prompt_ids, params)
        while any(s.finish_reason is None for s in seqs):
            if self.running_in_thread():
                time.sleep(0.002)
            else:
                self.step()
        return seqs

    # ---- the loop ---------------------------------------------------------------------
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._lock:
                while not self._stop and not self._updates and not self._aborts and (
                    self._paused or not self.has_work()
                ):
                    self._lock.wait()
                if self._stop:
                    return
            self.step()

    def _apply_updates(self) -> None:
        while self._updates:
            apply, version, done, out = self._updates.popleft()
            t0 = time.perf_counter()
            try:
                with torch.no_grad():
                    out["result"] = apply()  # dropped by update_weights, in the caller's thread
                self.version = self.slots.version = version
                self.reset_prefix_cache()  # idle prefixes were computed by the old weights
                self.stats.weight_updates += 1
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                out["error"] = exc
            self.stats.last_update_seconds = time.perf_counter() - t0
            done.set()

    def step(self) -> None:
        """One scheduler iteration; see the module docstring."""
        if self._updates:
            self._apply_updates()  # outside inference mode: new weights must stay ordinary tensors
        if self._aborts:
            self._apply_aborts()
        if self._paused:
            return
        with torch.inference_mode():
            self._admit()
            decode = [s for s in self.running if len(s.tokens) - s.cached == 1]
            prefill = [s for s in self.running if len(s.tokens) - s.cached > 1]
            scored = [s for s in prefill if s.scores_prompt and s.prompt_logprobs is None]
            if scored:  # each in a forward of its own: the logits of every position are [S, V]
                prefill = [s for s in prefill if s not in scored]
            if decode:
                self._forward(decode)
            for group in prefill_groups(prefill, self.prefill_group_cost):
                self._forward(group)
            for s in scored:
                self._forward([s], score_prompt=True)
        self.stats.steps += 1
        self.stats.last_batch_size = len(self.running)

    # ---- scheduling: slot i holds the i-th running sequence ----------------------------
    def _admit(self) -> None:
        """Move waiting sequences into the running batch, in arrival order, while it has room
        and this step's prefill budget lasts. The siblings of a group (``n > 1``) wait until
        their leader's prompt is in the cache, then copy it; the sequences behind them do
        not wait with them: a batch of groups prefills all its leaders in one forward, not
        one leader per step (8 groups of 8: 25 forwards a batch instead of 39)."""
        budget = self.max_prefill_tokens
        missing: list[Sequence] = []  # phases whose prompt KV was not found: finished unplaced
        siblings: list[Sequence] = []  # waiting for their leader's prompt, in arrival order
        with self._lock:
            while self.waiting and len(self.running) < self.max_batch_size:
                seq = self.waiting[0]
                if seq.leader is not None and seq.leader.unplaced:
                    seq.finish_reason, seq.unplaced = seq.leader.finish_reason, True  # its leader's KV is gone
                    missing.append(self.waiting.popleft())
                    continue
                if seq.leader is not None and seq.leader.cached < len(seq.prompt_ids) - 1:
                    siblings.append(self.waiting.popleft())  # copies the leader's prompt once it is cached
                    continue
                need = len(seq.prompt_ids)
                if need > budget and budget < self.max_prefill_tokens:
                    break  # this step's prefill budget is spent; keep arrival order
                self.waiting.popleft()
                self._place(seq, len(self.running))
                if seq.unplaced:  # placed nowhere: its phase says what the client does
                    missing.append(seq)
                    continue
                budget -= len(seq.prompt_ids) - seq.cached
                self.running.append(seq)
            self.waiting.extendleft(reversed(siblings))  # back at the front, in their order
        for seq in missing:
            if seq.on_done is not None:
                seq.on_done(seq)

    def _place(self, seq: Sequence, slot: int) -> None:
        """Give ``seq`` the slot after the running ones, with the longest cached prefix of its
        prompt in it (keep >= 1 token to run): a running sibling's prompt is copied; else the
        KV store's longest match is handed over (it is already in that slot) or loaded. A
        sequence that scores its prompt reuses nothing: every prompt position must run."""
        limit = len(seq.prompt_ids) - 1
        leader = seq.leader
        if leader is not None and leader.prompt_logprobs is not None:  # echo, n > 1: scored once
            seq.prompt_logprobs, seq.prompt_top_logprobs = leader.prompt_logprobs, leader.prompt_top_logprobs
        elif seq.scores_prompt and limit == 0:  # nothing predicts a one-token prompt's only token
            seq.prompt_logprobs, seq.prompt_top_logprobs = [None], [None]
        hit: PrefixHit | None = None
        sibling, n = None, 0
        if self.prefix_reuse and limit > 0 and not seq.scores_prompt:
            if leader is not None and leader.finish_reason is None and leader.slot >= 0:
                sibling, n = leader, limit
            else:
                hit = self.kv_store.lookup(salted_key(seq.prompt_ids, seq.params.cache_salt))
                n = min(hit.length, limit) if hit is not None else 0
                hit = hit if n > 0 else None
        if seq.phase is not None and sibling is None and n < seq.phase.must_find(len(seq.prompt_ids)):
            seq.finish_reason, seq.unplaced = seq.phase.unplaced_reason, True
            return
        if hit is None or hit.slot != slot:
            self.kv_store.vacate(slot, keep=hit)
            self.slots.acquire(slot)
        seq.slot = slot
        seq.kv_version = sibling.kv_version if sibling is not None else self.version
        if sibling is not None:
            self.slots.copy(sibling.slot, slot, n)
            routed = _take_rows(sibling.routed, n)
        elif hit is not None:
            routed = self.kv_store.load(hit, slot, n)
        else:
            return
        seq.cached = n
        seq.routed = routed
        self.stats.prefix_hit_tokens += n

    def _retire(self, seq: Sequence, *, keep_prefix: bool) -> None:
        """Take a finished sequence out of the running batch; the last running sequence
        moves into its slot, so slots stay compact. Its KV (all tokens but the last, which
        was never run) goes to the KV store when ``keep_prefix``."""
        i, last = seq.slot, self.running.pop()
        if last is not seq:
            self.cache.swap(i, last.slot, max(seq.cached, last.cached))
            seq.slot, last.slot = last.slot, i
            self.running[i] = last
        if keep_prefix and seq.phase is not None:  # its KV is still in its slot: the phase's turn
            seq.phase.retired(seq, current=seq.kv_version == self.version)
        if keep_prefix and self.prefix_reuse and not (self._current_kv_only and seq.kv_version != self.version):
            self.kv_store.keep(seq.slot, seq.cache_key(seq.cached), seq.routed)
        else:
            self.slots.release(seq.slot)

    # ---- running the model ------------------------------------------------------------
    def _forward(self, seqs: list[Sequence], score_prompt: bool = False) -> None:
        """One forward over ``seqs``' uncached tokens, then a sampled token per row. With
        ``score_prompt`` (one row, its whole prompt uncached) the logits of every position
        also give the prompt's log-probabilities."""
        device = self.param.device
        chunks = [s.tokens[s.cached:] for s in seqs]
        lens = [len(c) for c in chunks]
        width = max(lens)
        ids = torch.tensor([c + [0] * (width - len(c)) for c in chunks])  # [B, S] right-padded
        past = torch.tensor([s.cached for s in seqs])
        pos = past[:, None] + torch.arange(width)[None, :]  # [B, S]
        lengths = torch.tensor(lens)
        slot_ids = [s.slot for s in seqs]
        slots = range(slot_ids[0], slot_ids[0] + len(seqs))  # compact slots: the cache is read in place
        out = self.model(
            ids.to(device), pos.to(device), lengths.to(device),
            cache=self.cache,
            slots=slots if slot_ids == list(slots) else torch.tensor(slot_ids, device=device),
            past_lens=past.to(device),
            logits_for="all" if score_prompt else "last",
        )
        logits = out.logits  # [B, V]
        if score_prompt:  # [1, S, V]: every position's logits
            self._score_prompt(seqs[0], logits[0])
            logits = logits[:, -1]
        routed = getattr(out, "routed_experts", None)  # [B, S, L, k] or None
        params = [s.params for s in seqs]
        tokens, logps, logp_all = sample(
            logits,
            torch.tensor([p.temperature for p in params], device=device),
            torch.tensor([p.top_k for p in params], device=device),
            torch.tensor([p.top_p for p in params], device=device),
            [s.generator for s in seqs],
        )
        want_top = max((p.logprobs or 0) for p in params)
        top = None
        if want_top:
            top = logp_all.topk(want_top)
        tokens_l, logps_l = tokens.tolist(), logps.tolist()
        if routed is not None:
            # one conversion, then per-row views from one unbind (not two indexing ops a row)
            routed = routed.to("cpu", self.routed_dtype).unbind(0)  # B x [S, L, k]
        for i, s in enumerate(seqs):
            n_new = lens[i]
            if routed is not None:
                s.routed.append(routed[i] if n_new == width else routed[i][:n_new])
            s.cached += n_new
            if not s.params.max_tokens:  # prefill only (echo scoring): nothing is sampled
                continue
            s.output_ids.append(tokens_l[i])
            s.logprobs.append(logps_l[i])
            s.versions.append(self.version)
            if top is not None and s.params.logprobs:
                k = s.params.logprobs
                s.top_logprobs.append(dict(zip(top.indices[i, :k].tolist(), top.values[i, :k].tolist())))
            self.stats.generated_tokens += 1
            if len(s.output_ids) == 1:
                self.stats.prompt_tokens += len(s.prompt_ids)
        # After every row's ``cached`` is current (retiring swaps slots by cached length); from
        # the last slot down, so a finished row at the end of the batch moves nothing: a batch
        # that finishes together swaps no KV rows at all.
        for s in reversed(seqs):
            self._check_finished(s)

    def _score_prompt(self, s: Sequence, logits: torch.Tensor) -> None:
        """The log-probability of every prompt token after the first, from ``logits`` [P, V],
        under the request's temperature exactly as sampled tokens are scored
        (:mod:`primerl.sampling`: ``log_softmax(scale(logits, T))``, float32, T = 0 scored at 1),
        plus the top-k alternatives when asked. In chunks of positions, to bound memory."""
        p, k = s.params, s.params.prompt_logprobs
        targets = torch.tensor(s.prompt_ids[1:], device=logits.device)
        values: list[float | None] = [None]
        tops: list[dict[int, float] | None] = [None]
        for a in range(0, len(targets), 256):
            logp = torch.log_softmax(scale(logits[a : a + 256][: len(targets) - a], p.temperature), dim=-1)
            values += logp.gather(-1, targets[a : a + 256, None]).squeeze(-1).tolist()
            if k:
                top = logp.topk(k)
                tops += [dict(zip(ix, v)) for ix, v in zip(top.indices.tolist(), top.values.tolist())]
        s.prompt_logprobs = values
        s.prompt_top_logprobs = tops if k else None

    def _check_finished(self, s: Sequence) -> None:
        p = s.params
        if not s.output_ids:  # max_tokens=0: the prompt is in the cache (and scored); done
            s.finish_reason = "length"
            self.stats.prompt_tokens += len(s.prompt_ids)
            self._retire(s, keep_prefix=True)
            if s.on_done is not None:
                s.on_done(s)
            return
        tok = s.output_ids[-1]
        if ((tok in self.eos and not p.ignore_eos) or tok in p.stop_token_ids
                or (p.stop and self._hit_stop_string(s))):
            s.finish_reason = "stop"
        elif len(s.output_ids) >= p.max_tokens or len(s.tokens) >= self.max_model_len:
            s.finish_reason = "length"
        if s.finish_reason is None:
            return
        self._retire(s, keep_prefix=True)
        if s.on_done is not None:
            s.on_done(s)

    def _hit_stop_string(self, s: Sequence) -> bool:
        text = self.decode(s.output_ids)
        hits = [text.find(stop) for stop in s.params.stop if stop and stop in text]
        if hits:
            s.stop_text_at = min(hits)
            return True
        return False

    decode: Callable[[list[int]], str] = staticmethod(lambda ids: "")  # set by the backend


def prefill_groups(seqs: list[Sequence], group_cost: int) -> list[list[Sequence]]:
    """Split prefill rows into forwards of similar lengths.

    A forward pads every row to its longest, and on the CPU the padding costs about as
    much as real tokens (token-wise layers run on it). Rows sorted by length are cut into
    consecutive groups minimising sum(rows x longest) + ``group_cost`` per group (an
    exact dynamic programme, O(n^2) over at most a batch of rows). Prompts of 8 to 64
    tokens become two or three forwards; prompts of one length stay one. Each group keeps
    the rows' running order, so a group of consecutive slots still reads the cache in place.
    """
    if len(seqs) <= 1:
        return [seqs] if seqs else []
    rank = {id(s): r for r, s in enumerate(seqs)}
    order = sorted(seqs, key=lambda s: len(s.tokens) - s.cached)
    lens = [len(s.tokens) - s.cached for s in order]
    n = len(order)
    best = [0] + [float("inf")] * n  # best[i]: cheapest split of the i shortest rows
    cut = [0] * (n + 1)
    for i in range(1, n + 1):
        for j in range(i):  # last group = rows j..i-1, padded to lens[i - 1]
            cost = best[j] + (i - j) * lens[i - 1] + group_cost
            if cost < best[i]:
                best[i], cut[i] = cost, j
    groups, i = [], n
    while i:
        groups.append(sorted(order[cut[i] : i], key=lambda s: rank[id(s)]))
        i = cut[i]
    return groups[::-1]


def _take_rows(chunks: list[torch.Tensor], n: int) -> list[torch.Tensor]:
    """The first n rows of a list of [rows, ...] chunks."""
    out, left = [], n
    for c in chunks:
        if left <= 0:
            break
        out.append(c[:left])
        left -= len(c[:left])
    return out

