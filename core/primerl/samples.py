"""One training sample, and the versioned on-disk format of a step's batch.

A :class:`Sample` is what crosses from rollouts to training: the exact tokens the engine
saw and produced, which of them the model sampled (``loss_mask``), the engine's logprob
and policy version of each sampled token, the experts it routed each token to (router
replay, R3), the reward and the group-relative advantage. The orchestrator builds them
from single-turn completions and multi-turn episodes, agent envs through
:func:`primerl.envs.agent.interleave`, the trainer's SFT warm-up from reference answers;
packing and the loss read them. One record, checked once at construction, so a sample
whose per-token lists disagree fails where it is made, not deep in the trainer.

A :class:`RolloutBatch` is trainer step n's input, written by the orchestrator to
``rollouts/step_n.pt`` (:meth:`primerl.rundir.RunDir.batch`) with :func:`write_batch`
and read back with :func:`read_batch`. The file is ``torch.save`` of plain Python
containers and tensors::

    {"format": "primerl.rollouts", "version": 1, "step": n,
     "samples": [Sample.to_dict(), ...], "metrics": {"reward/mean": ..., ...}}

A reader refuses a file of another format or a newer version with a message saying so;
fields added later get defaults, so version 1 files stay readable.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

__all__ = ["NO_VERSION", "RolloutBatch", "Sample", "decode_routed_experts", "episodes", "read_batch", "write_batch"]

FORMAT = "primerl.rollouts"
FORMAT_VERSION = 1
NO_VERSION = -1  # ``versions`` on tokens the model did not sample (prompt, env turns)


@attrs.define(kw_only=True, eq=False)
class Sample:
    """One sequence to train on; every per-token list has ``len(tokens)`` entries."""

    tokens: list[int]  # prompt + completion (+ env turns), exactly as the engine saw and produced them
    loss_mask: list[int]  # 1 on tokens the model sampled, 0 on prompt and env tokens
    logprobs: list[float] | None = None  # the engine's logprob of each sampled token, 0.0 elsewhere
    versions: list[int] | None = None  # policy version that sampled each token, NO_VERSION elsewhere
    reward: float = 0.0
    advantage: float = 0.0  # set by the orchestrator per group (or per episode of an agent env)
    temperature: float = 1.0  # sampling temperature: the trainer's logprobs use the same
    # [len(tokens) - 1 or len(tokens), moe_layers, top_k] integer tensor: the experts the
    # engine routed each input token to (R3); the last sampled token was never an input
    routed_experts: Any = None
    task_id: str = ""
    source: str = ""  # the source it trains for (orchestrator.sources; [env]'s name alone); "" when unknown
    episode: int | None = None  # agent envs: the episode within its group (advantages are per episode)
    turns: int | None = None  # multi-turn envs: model turns in the sample

    def __attrs_post_init__(self) -> None:
        n = len(self.tokens)
        for name, value in (("loss_mask", self.loss_mask), ("logprobs", self.logprobs), ("versions", self.versions)):
            if value is not None and len(value) != n:
                raise ValueError(f"sample of task {self.task_id!r}: {name} has {len(value)} entries for {n} tokens")
        if self.routed_experts is not None and self.routed_experts.shape[0] not in (n - 1, n):
            raise ValueError(f"sample of task {self.task_id!r}: routed_experts covers {self.routed_experts.shape[0]} "
                             f"tokens, expected {n - 1} or {n}")

    @property
    def sampled_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def oldest_version(self) -> int | None:
        """The oldest policy version among the sampled tokens (None: nothing was sampled)."""
        return min((v for v in self.versions or () if v >= 0), default=None)

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self, recurse=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Sample:
        known = {f.name for f in attrs.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def episodes(samples: list[Sample]) -> dict[Any, tuple[float, list[Sample]]]:
    """A group's episodes in order, each its reward and its samples: an agent env's episode
    may train as several samples (``episode`` set); any other sample is one episode."""
    out: dict[Any, tuple[float, list[Sample]]] = {}
    for i, s in enumerate(samples):
        key = s.episode if s.episode is not None else i
        out.setdefault(key, (s.reward, []))[1].append(s)
    return out


def decode_routed_experts(payload: dict[str, Any] | None) -> Any:
    """The ``[tokens, moe_layers, top_k]`` tensor of an engine's ``routed_experts`` payload.

    The payload is the inference API's JSON (vLLM's layout: ``data`` base64 of the raw
    array, ``dtype``, ``shape``, ``start``), or None when the engine returned none.
    """
    if not payload:
        return None
    import base64

    import numpy as np
    import torch

    if payload.get("start", 0) != 0:
        raise ValueError(f"routed experts that start at token {payload['start']} cannot be aligned with the sample")
    data = payload["data"]  # base64 text, or its raw bytes (verifiers' sidecar hands a memoryview)
    raw = base64.b64decode(bytes(data) if not isinstance(data, str) else data)
    array = np.frombuffer(raw, dtype=payload["dtype"]).reshape(payload["shape"])
    return torch.from_numpy(array.copy())


@attrs.define(kw_only=True)
class RolloutBatch:
    """Trainer step ``step``'s samples and the orchestrator's metrics of them."""

    step: int
    samples: list[Sample]
    metrics: dict[str, Any] = attrs.Factory(dict)


def write_batch(path: Path, batch: RolloutBatch) -> None:
    """Write ``batch`` to ``path`` atomically (a temporary name, then a rename)."""
    import torch

    from primerl.rundir import write_atomically

    payload = {"format": FORMAT, "version": FORMAT_VERSION, "step": batch.step,
               "samples": [s.to_dict() for s in batch.samples], "metrics": batch.metrics}
    write_atomically(Path(path), lambda tmp: torch.save(payload, tmp))


def read_batch(path: Path) -> RolloutBatch:
    """Read a batch file, refusing other formats and newer versions by name."""
    import torch

    # our own orchestrator's file in the run directory; metrics may hold numpy scalars
    data = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path} is not a primerl rollout batch (no format '{FORMAT}'): "
                         f"was it written by another program or an older primerl? Delete it to regenerate it.")
    if data["version"] > FORMAT_VERSION:
        raise ValueError(f"{path} is rollout batch format version {data['version']}; this primerl reads up to "
                         f"{FORMAT_VERSION}: upgrade primerl to train on it")
    return RolloutBatch(step=int(data["step"]), samples=[Sample.from_dict(s) for s in data["samples"]],
                        metrics=dict(data.get("metrics", {})))
