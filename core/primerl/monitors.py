"""The monitor contract: where a run's metrics go besides the trainer's log.

Every trainer step makes one metrics record (the orchestrator's batch metrics merged with
the trainer's own). A :class:`Monitor` (a plugin, ``register_monitors``) receives each of
them, and every ``samples_every`` steps a few of the step's rollouts as
:class:`SampleRow` records (prompt and completion text, reward, advantage, source). The
built-in ``file`` monitor writes ``metrics.jsonl`` (what the live view, the reward plot and
resume read) and draws ``reward.png`` when the run ends; it declares itself always on
(:class:`MonitorCapabilities`) and cannot be switched off. ``wandb`` and ``tensorboard``
(plugins under ``plugins/monitors``) send the same records to Weights & Biases and to
TensorBoard event files.

Configuration is one ``[monitors.<name>]`` table per monitor, checked by the monitor's own
``Config`` (a subclass of :class:`MonitorConfig`, the way ``[env]`` is checked by the env's
``Config``): naming a monitor's table with any key switches it on, ``enabled = false``
switches it off (``primerl.config`` resolves that; the resolved config lists every monitor
that runs, always-on ones first, with ``enabled = true``).

Why monitors are kept apart from training: a dashboard is worth having but never worth a
run. :class:`MonitorSet` (what the trainer's publishing rank holds) gives each step's
record to the monitors in order, the file monitor first; one that fails (its library is
not installed, no network, an exception in ``log``) is reported once in the trainer log
(``warning: monitor NAME: ...; the run goes on without it``) and dropped, and the others
and the run go on. Only an always-on monitor's failure stops the trainer: without
``metrics.jsonl`` the live view and resume have nothing to read. A monitor's module
stays light (the config check imports it for its ``Config``): it imports its library in
``start``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

import attrs

from primerl.sections import declared_config
from primerl.validators import non_negative

__all__ = ["COLUMNS", "Monitor", "MonitorCapabilities", "MonitorConfig", "MonitorSet", "RunInfo", "SampleRow",
           "json_record", "one_line", "sample_rows", "wants_samples", "with_always_on"]

SAMPLE_ROWS = 8  # rollouts per sample table: a few of the step's groups, not the whole batch
SAMPLE_TEXT_CHARS = 2000  # a prompt's or completion's text beyond this is cut (an agent's long episodes)


@attrs.define(kw_only=True)
class MonitorConfig:
    """The keys every ``[monitors.<name>]`` table takes; a monitor's ``Config`` (a subclass)
    adds its own (docs/monitors.md lists each built-in monitor's)."""

    # whether the monitor runs; setting any other key of its table switches it on too, and
    # an always-on monitor (file) cannot be switched off
    enabled: bool = False
    # rollout sample tables (a few prompts, completions and rewards of the step) on step 1
    # and every samples_every steps after it; 0: none. Monitors that show no samples
    # (file) ignore it
    samples_every: int = attrs.field(default=0, validator=non_negative)


@attrs.frozen(kw_only=True)
class MonitorCapabilities:
    """What a monitor declares when it registers (``register(..., capabilities=...)``).

    ``always_on``: it runs in every run and ``enabled = false`` is a config error (the
    ``file`` monitor: the live view and resume read ``metrics.jsonl``); its failures stop
    the trainer instead of being dropped.
    """

    always_on: bool = False
    why: str = ""  # with always_on: what needs it, for the error that refuses enabled = false


def with_always_on(monitors: Mapping[str, MonitorConfig], registry: Any) -> dict[str, MonitorConfig]:
    """``monitors`` (name -> options) with every installed always-on monitor first: its
    options from ``monitors`` when given, else its ``Config``'s defaults, switched on."""
    first: dict[str, MonitorConfig] = {}
    for c in registry.of_kind("monitor"):
        if c.error is not None or not (c.capabilities or MonitorCapabilities()).always_on:
            continue
        if c.name in monitors:
            first[c.name] = monitors[c.name]
        else:
            first[c.name] = declared_config(c.load(), "monitor", c.name, MonitorConfig)(enabled=True)
    return {**first, **{k: v for k, v in monitors.items() if k not in first}}


@attrs.frozen(kw_only=True)
class RunInfo:
    """What a monitor is told of the run when it starts."""

    output_dir: Path  # the run directory: a monitor's files go under it (OUT/wandb, OUT/tensorboard)
    name: str  # the run directory's name: the default run name of a dashboard
    config: dict[str, Any]  # the whole resolved config (primerl.config.to_dict), logged once
    start_step: int  # the step the trainer starts after: 0, or the checkpoint's step on a resume
    max_steps: int
    log: Callable[[str], None] = print  # a line in the trainer's log (where its offline files are, say)


@attrs.frozen(kw_only=True)
class SampleRow:
    """One rollout of a step's batch, as a sample table shows it."""

    step: int
    source: str  # the environment it trained for (orchestrator.sources; [env]'s name alone)
    task_id: str
    prompt: str  # the tokens before the first sampled one, decoded ("" when it cannot be)
    completion: str  # the rest (model turns, and env turns of a multi-turn episode), decoded
    reward: float
    advantage: float
    prompt_tokens: int
    completion_tokens: int  # the tokens the model sampled

    def as_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


COLUMNS = tuple(f.name for f in attrs.fields(SampleRow))


@runtime_checkable
class Monitor(Protocol):
    """Where a run's metrics go (``register_monitors``; see docs/plugins.md and docs/monitors.md).

    The target is a class, instantiated with its options (an instance of its ``Config``
    class attribute: :class:`MonitorConfig`, or a subclass with the monitor's own keys), on
    the trainer's publishing rank only. ``start`` is called once
    before the first step, ``log`` once per step with the exact record appended to
    ``metrics.jsonl`` (JSON values: numbers mostly), ``log_samples`` on the steps its
    ``samples_every`` picks, ``finish`` once at the end (also when the trainer fails).
    Any exception is reported once and the monitor is dropped.
    """

    Config: ClassVar[type[MonitorConfig]]  # the class that checks [monitors.<name>]

    def start(self, run: RunInfo) -> None: ...

    def log(self, step: int, metrics: Mapping[str, Any]) -> None: ...

    def log_samples(self, step: int, rows: Sequence[SampleRow]) -> None: ...

    def finish(self) -> None: ...


def wants_samples(options: MonitorConfig, step: int) -> bool:
    """Whether a monitor with ``options`` gets sample rows at ``step``: step 1, then every
    ``samples_every`` steps."""
    every = options.samples_every
    return every > 0 and (step - 1) % every == 0


def _json_default(v: Any) -> Any:
    """Tensors, numpy arrays and scalars as JSON numbers or lists; anything else as its text."""
    torch, numpy = sys.modules.get("torch"), sys.modules.get("numpy")  # loaded: a value can be one of theirs
    if torch is not None and isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else v.tolist()
    if numpy is not None and isinstance(v, (numpy.ndarray, numpy.generic)):
        return v.tolist()
    return str(v)


def json_record(record: Mapping[str, Any]) -> str:
    """A metrics record as the one JSON line of ``metrics.jsonl`` (no newline)."""
    return json.dumps(dict(record), default=_json_default)


def one_line(exc: BaseException) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= 400 else text[:397] + "..."


@attrs.define(eq=False)
class _Active:
    name: str
    options: MonitorConfig
    always_on: bool
    monitor: Any = None  # None until built


class MonitorSet:
    """The run's monitors, in order (always-on ones first), each guarded: the trainer's one
    handle on them. On ranks that publish nothing it is empty."""

    def __init__(self, active: Sequence[_Active] = (), *, log: Callable[[str], None] = print) -> None:
        self._active = list(active)
        self._log = log

    @classmethod
    def for_run(cls, cfg: Any, *, log: Callable[[str], None], registry: Any) -> MonitorSet:
        """The monitors ``cfg.monitors`` switches on, built (each its plugin's class with its
        options) from ``registry`` (:func:`primerl.registry.get_registry`: the registry reads
        this module's capability record, so this module never imports it); one that cannot be
        built is reported once and left out."""
        reg = registry
        out = cls(log=log)
        for name, options in with_always_on(cfg.monitors, reg).items():
            if not options.enabled:
                continue
            entry = _Active(name=name, options=options, always_on=False)
            try:
                entry.always_on = reg.capabilities("monitor", name).always_on
                entry.monitor = reg.load("monitor", name)(options)
            except Exception as exc:  # a broken monitor is reported, never fatal (re-raised: an always-on one)
                if entry.always_on:
                    raise
                out._warn(entry, exc)
                continue
            out._active.append(entry)
        return out

    @property
    def names(self) -> list[str]:
        """The monitors still running, in order."""
        return [a.name for a in self._active]

    def _warn(self, entry: _Active, exc: BaseException) -> None:
        self._log(f"warning: monitor {entry.name}: {one_line(exc)}; the run goes on without it")

    def _guarded(self, entry: _Active, method: Callable[..., Any], *args: Any) -> None:
        """``method(*args)``, a method of ``entry.monitor``; a failure drops the monitor, said
        once (an always-on monitor's failure is the trainer's)."""
        try:
            method(*args)
        except Exception as exc:  # a monitor never stops the run (re-raised: an always-on one)
            if entry.always_on:
                raise
            self._active.remove(entry)
            self._warn(entry, exc)
            if method.__name__ not in ("start", "finish"):  # flush what it has (a dashboard's buffered steps), quietly
                try:
                    entry.monitor.finish()
                except Exception:  # noqa: BLE001 - already reported
                    pass

    def start(self, run: RunInfo) -> None:
        for entry in list(self._active):
            self._guarded(entry, entry.monitor.start, run)

    def log(self, step: int, record: Mapping[str, Any]) -> None:
        """``record`` to every monitor, as the exact values of its ``metrics.jsonl`` line."""
        if not self._active:
            return
        values = json.loads(json_record(record))
        for entry in list(self._active):
            self._guarded(entry, entry.monitor.log, step, values)

    def wants_samples(self, step: int) -> bool:
        """Whether a monitor takes sample rows at ``step`` (the trainer decodes them only then)."""
        return any(wants_samples(a.options, step) for a in self._active)

    def log_samples(self, step: int, rows: Sequence[SampleRow]) -> None:
        for entry in list(self._active):
            if wants_samples(entry.options, step):
                self._guarded(entry, entry.monitor.log_samples, step, rows)

    def finish(self) -> None:
        """Every monitor's ``finish``, each guarded; the set is empty afterwards."""
        try:
            for entry in list(self._active):
                self._guarded(entry, entry.monitor.finish)
        finally:
            self._active = []


def _cut(text: str) -> str:
    return text if len(text) <= SAMPLE_TEXT_CHARS else text[:SAMPLE_TEXT_CHARS] + " [...]"


def _decode(tokenizer: Any, ids: Sequence[int]) -> str:
    if tokenizer is None or not ids:
        return ""
    try:
        return _cut(tokenizer.decode(list(ids)))
    except Exception:  # noqa: BLE001 - a tokenizer that cannot decode: the row keeps its token counts
        return ""


def sample_rows(step: int, samples: Sequence[Any], tokenizer: Any = None, *, rows: int = SAMPLE_ROWS) -> list[SampleRow]:
    """A few of a batch's :class:`primerl.samples.Sample` records as sample rows, spread over
    the batch (so over its groups and sources), decoded with ``tokenizer`` when given."""
    if not samples:
        return []
    stride = max(1, len(samples) // rows)
    out = []
    for s in list(samples)[::stride][:rows]:
        first = next((i for i, m in enumerate(s.loss_mask) if m), len(s.tokens))
        out.append(SampleRow(step=step, source=s.source, task_id=s.task_id, prompt=_decode(tokenizer, s.tokens[:first]),
                             completion=_decode(tokenizer, s.tokens[first:]), reward=float(s.reward),
                             advantage=float(s.advantage), prompt_tokens=first, completion_tokens=s.sampled_tokens))
    return out
