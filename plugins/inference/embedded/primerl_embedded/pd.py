"""Prefill/decode disaggregation on the embedded engine, as a wrapper: the two phases are
:class:`~primerl_embedded.engine.Phase` objects a request brings to the engine, whose
scheduler only asks them where a sequence's prompt KV must come from and tells them when
it retired (``inference.prefill_replicas`` / ``decode_replicas``; the client side is
:mod:`primerl.orchestrator.client`).

A prompt's KV goes from the prefill server that computed it to the decode server that
samples from it through the block tier of the KV store every server shares (``disk`` with
a shared directory, ``mooncake``; :class:`primerl.kv_blocks.BlockSlotStore`):

* a **prefill** phase runs the prompt (no token is sampled) and, when it retires, writes the
  prompt's full blocks to the store at once (:meth:`KVHandoff.publish`, whatever the store's
  own write policy), each with its tokens' routed experts, under the current policy
  version's keys;
* a **decode** phase looks its prompt up as any sequence does and must find every full block
  (:meth:`KVHandoff.needed`; the tail shorter than a block, and always the last token, run
  here). The blocks' routed experts become its prompt tokens' (router replay stays exact). A
  miss (the blocks were evicted, their server left the pool, or the weights changed in
  between: block keys carry the version) retires it unplaced with ``finish_reason``
  :data:`KV_MISSING`, and the client runs the prefill again.
"""

from __future__ import annotations

import torch

from primerl.kv_blocks import BlockSlotStore
from primerl.kv_stores import HandoffUnavailable, KVStore
from primerl_embedded.engine import RequestError, SamplingParams, Sequence

KV_MISSING = "kv_missing"  # finish_reason of a decode phase whose prompt KV the store does not hold


class KVHandoff:
    """A server's use of the shared KV store's block tier for prefill/decode disaggregation."""

    def __init__(self, store: KVStore) -> None:
        try:
            self.blocks: BlockSlotStore | None = store.handoff_blocks()
            self.unavailable: str | None = None
        except HandoffUnavailable as exc:  # the store says why (and what to run instead)
            self.blocks, self.unavailable = None, str(exc)

    @property
    def block_size(self) -> int:
        return self.blocks.block_size if self.blocks is not None else 0

    def check(self, params: SamplingParams, prefix_reuse: bool) -> None:
        """Refuse a phase this engine cannot serve (a :class:`RequestError`, one line)."""
        if self.blocks is None:
            raise RequestError(self.unavailable)
        if not prefix_reuse:
            raise RequestError("this model's KV cache has recurrent state (Mamba layers) that cannot be restored "
                               "from blocks: prefill/decode disaggregation cannot serve it")
        if params.prompt_logprobs is not None:
            raise RequestError("a prompt that is scored (echo with logprobs) runs whole on one server: send it "
                               "without kv_transfer_params")

    def needed(self, prompt_len: int) -> int:
        """Prompt tokens a decode phase must find in the store: every full block (the last
        token always runs, so a block-aligned prompt's last block is used up to it)."""
        return min(prompt_len // self.block_size * self.block_size, prompt_len - 1)

    def publish(self, slot: int, tokens: list[int], routed: list[torch.Tensor]) -> int:
        """Write the full blocks of ``tokens`` (in ``slot``) that the store lacks, now; how
        many of them, from the first, it holds afterwards."""
        self.blocks.save(slot, tokens, routed)
        return self.blocks.blocks.contains(self.blocks.keys(tokens))

    def phase(self, name: str) -> PrefillPhase | DecodePhase:
        """The phase a request asks for (``"prefill"`` or ``"decode"``), over this handoff."""
        if name == "prefill":
            return PrefillPhase(self)
        if name == "decode":
            return DecodePhase(self)
        raise RequestError(f"kv_transfer_params: phase must be 'prefill' or 'decode', got {name!r}")


class PrefillPhase:
    """Run the prompt, and when it retires write its full blocks to the store (``blocks``: how
    many the store holds then; 0 when the weights changed under it)."""

    unplaced_reason = KV_MISSING  # never: a prefill needs nothing cached

    def __init__(self, handoff: KVHandoff) -> None:
        self.handoff = handoff
        self.blocks = 0

    def check(self, params: SamplingParams, prefix_reuse: bool) -> None:
        self.handoff.check(params, prefix_reuse)

    def must_find(self, prompt_len: int) -> int:
        return 0

    def retired(self, seq: Sequence, current: bool) -> None:
        self.blocks = self.handoff.publish(seq.slot, seq.cache_key(seq.cached), seq.routed) if current else 0


class DecodePhase:
    """Find every full block of the prompt in the store, or finish unplaced (:data:`KV_MISSING`)."""

    unplaced_reason = KV_MISSING

    def __init__(self, handoff: KVHandoff) -> None:
        self.handoff = handoff

    def check(self, params: SamplingParams, prefix_reuse: bool) -> None:
        self.handoff.check(params, prefix_reuse)

    def must_find(self, prompt_len: int) -> int:
        return self.handoff.needed(prompt_len)

    def retired(self, seq: Sequence, current: bool) -> None:
        pass  # its KV goes where any sequence's goes (the store's own policy)
