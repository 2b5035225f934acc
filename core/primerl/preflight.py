"""The preflight: build what the config names, so a bad pick or option fails before anything starts.

Loading (:func:`primerl.config.load_config`) structures the sections and checks every key's
type and validators; it imports no component. The preflight then checks what needs the
components themselves, each error a ConfigError of one line naming the key and its origin
(the CLI prints it and exits with code 2):

* the model: the trainer settings its plugin's ``ModelCapabilities`` must grant (expert or
  context parallel, router replay, FP8, LoRA) for this preset or checkpoint;
* every key that names a plugin (``COMPONENT_KEYS``) names one that is installed and loads,
  and the options of a router or KV store fit its constructor;
* the loss, the correction and every advantage estimator build with their options, and what
  they need of the run (a sequence-level loss and context parallel do not mix);
* prefill/decode disaggregation's rules every backend shares, then the backend's own
  ``Config.check`` with the whole run.

:func:`load_checked` is loading then the preflight: what ``primerl run`` and every process
command call.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from primerl.algorithms import build_advantage, build_correction, build_loss
from primerl.config import ConfigSources, RunConfig, load_config
from primerl.errors import ConfigError, PluginError, PrimerlError
from primerl.registry import get_registry, is_target, options_problem
from primerl.structuring import first_origin_under, origin_of, origin_under

__all__ = ["COMPONENT_KEYS", "MODEL_NEEDS", "OPTIONS_KEYS", "load_checked", "preflight"]


def load_checked(src: ConfigSources, explicit: Mapping[str, Any] | None = None, registry: Any = None,
                 origins: dict[str, str] | None = None) -> RunConfig:
    """:func:`primerl.config.load_config` (same arguments), then :func:`preflight`."""
    sources: dict[str, str] = {} if origins is None else origins
    cfg = load_config(src, explicit, registry, origins=sources)
    preflight(cfg, sources, registry)
    return cfg


def preflight(cfg: RunConfig, sources: Mapping[str, str], registry: Any = None) -> None:
    """Every check that builds or loads a component, in order; ``sources``: where each key
    came from (the ``origins`` :func:`load_config` filled)."""
    reg = registry or get_registry()
    _check_model(cfg, reg, sources)
    _check_components(cfg, reg, sources)
    _check_algorithms(cfg, sources)
    _check_pd(cfg, reg, sources)
    cfg.inference.check(cfg, sources)  # the backend's rules that need the whole run


# config key -> the plugin kind it names (the plugin sections [model] and [env] load with the config)
COMPONENT_KEYS = {
    "inference.backend": "inference_backend",
    "inference.router": "router",
    "inference.kv_store": "kv_store",
    "trainer.parallelism": "parallelism",
    "launcher.name": "launcher",
    "trainer.loss": "loss",
    "trainer.correction": "correction",
    "orchestrator.advantage": "advantage",
}


# a component key -> the key holding its constructor's keyword arguments
OPTIONS_KEYS = {"inference.router": "inference.router_options", "inference.kv_store": "inference.kv_store_options"}


# what a trainer setting asks of the model: (key, is it asked, does ModelCapabilities grant it, in words, the fix)
MODEL_NEEDS = (
    ("trainer.parallel.ep", lambda t: t.parallel.ep > 1, lambda c: c.expert_parallel, "expert parallel", "set it to 1"),
    ("trainer.parallel.cp", lambda t: t.parallel.cp > 1, lambda c: c.context_parallel, "context parallel", "set it to 1"),
    ("trainer.router_replay", lambda t: t.router_replay, lambda c: c.router_replay, "router replay", "leave it off"),
    ("trainer.fp8", lambda t: t.fp8, lambda c: c.fp8, "FP8 training", "leave it off"),
    ("trainer.lora.rank", lambda t: t.lora.rank > 0, lambda c: c.lora, "LoRA", "set it to 0"),
)


def _check_model(cfg: RunConfig, reg: Any, sources: Mapping[str, str]) -> None:
    """Trainer settings the model must support (its plugin's ModelCapabilities for this
    preset or checkpoint): refused here, naming the key, not in a rank minutes later."""
    adapter = reg.load("model", cfg.model.name)()
    try:
        caps = adapter.capabilities(cfg.model)
    except (OSError, ValueError, PrimerlError) as exc:
        key = "model.checkpoint" if cfg.model.checkpoint else "model.preset"
        raise ConfigError(f"{key} ({origin_of(sources, key)}): {exc}") from None
    for key, asked, granted, words, fix in MODEL_NEEDS:
        if asked(cfg.trainer) and not granted(caps):
            what = f"checkpoint {cfg.model.checkpoint}" if cfg.model.checkpoint else f"preset '{cfg.model.preset}'"
            raise ConfigError(f"{key} ({origin_of(sources, key)}): model '{cfg.model.name}' ({what}) does not support "
                              f"{words}: {fix}")


def _field(section: Any, name: str) -> Any:
    """The value of field ``name`` of the attrs config ``section``."""
    return getattr(section, name)  # a field named by a config key, not a capability


def _check_components(cfg: RunConfig, reg: Any, sources: Mapping[str, str]) -> None:
    """Every key that names a plugin names one that is installed and loads, so a typo
    fails here, naming the key, instead of in a process minutes into the run."""
    for key, kind in COMPONENT_KEYS.items():
        section, _, field = key.partition(".")
        table = _field(cfg, section)
        if field not in attrs.fields_dict(type(table)):
            continue
        name = _field(table, field)
        if (key == "inference.backend" and cfg.trainer.weight_channel == "nccl"
                and reg.capabilities(kind, name).weight_sender is None):
            raise ConfigError(
                f"trainer.weight_channel = 'nccl' ({origin_of(sources, 'trainer.weight_channel')}) sends weights "
                f"straight to the inference servers, which inference.backend {name!r} cannot receive: use "
                f"--inference.backend vllm on GPUs, or --trainer.weight_channel filesystem (or shm)")
        if key == "trainer.parallelism":
            name = cfg.trainer.resolved_parallelism(cfg.trainer_world_size())
        if key == "trainer.correction" and not name:
            continue  # none
        try:
            reg.find(kind, name)
        except PluginError as exc:
            if kind in ("loss", "correction", "advantage") and is_target(name):
                continue  # a "module:attr" function, imported (and checked) by the process that uses it
            raise ConfigError(f"{key} = {name!r} ({origin_of(sources, key)}): {exc}") from None
        if key == "trainer.parallelism" and 0 < reg.capabilities(kind, name).max_ranks < cfg.trainer_world_size():
            raise ConfigError(
                f"trainer.parallelism {name!r} ({origin_of(sources, key)}) lays out at most "
                f"{reg.capabilities(kind, name).max_ranks} trainer rank(s), but the trainer has "
                f"{cfg.trainer_world_size()} (trainer.nproc {cfg.trainer.nproc} x {cfg.launcher.trainer_nodes_used()} "
                f"trainer node(s)): use trainer.parallelism fsdp (or auto)")
        options_key = OPTIONS_KEYS.get(key)
        options = _field(cfg.inference, options_key.partition(".")[2]) if options_key else None
        if options:
            why = options_problem(kind, name, options)
            if why:
                where = first_origin_under(sources, options_key) or "the defaults"
                raise ConfigError(f"{options_key} (from {where}) do not fit {kind} {name!r}: {why}")


def _check_algorithms(cfg: RunConfig, sources: Mapping[str, str]) -> None:
    """The loss, the correction and every advantage estimator build with their options (each
    checks its own), and what they need of the run: a sequence-level one needs every token
    of a sample in one forward, which context parallel does not give."""

    t, o = cfg.trainer, cfg.orchestrator
    picks = [("trainer.loss", t.loss, "trainer.loss_options", t.loss_options, build_loss),
             ("trainer.correction", t.correction, "trainer.correction_options", t.correction_options, build_correction),
             ("orchestrator.advantage", o.advantage, "orchestrator.advantage_options", o.advantage_options,
              build_advantage)]
    for i, sc in enumerate(o.sources):
        if sc.advantage:
            picks.append((f"orchestrator.sources[{i}].advantage", sc.advantage,
                          f"orchestrator.sources[{i}].advantage_options", sc.advantage_options, build_advantage))
    for key, name, options_key, options, build in picks:
        if not name or is_target(name):
            if options and not name:
                raise ConfigError(f"{options_key} ({origin_under(sources, options_key)}) set, but {key} names no "
                                  f"component: name one, or drop the options")
            continue  # a "module:attr" factory is built (and checked) by the process that uses it
        try:
            built = build(name, options)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{options_key} ({origin_under(sources, options_key)}) do not fit {key} {name!r}: "
                              f"{exc}") from None
        if key.startswith("trainer.") and built.sequence_level and t.parallel.cp > 1:
            raise ConfigError(f"{key} = {name!r} ({origin_of(sources, key)}) works on whole sequences, which context "
                              f"parallel (trainer.parallel.cp = {t.parallel.cp}) splits over ranks: set cp to 1, "
                              f"or pick a token-level one")
    if o.overlong_buffer >= o.max_tokens:
        raise ConfigError(f"orchestrator.overlong_buffer ({o.overlong_buffer}, {origin_of(sources, 'orchestrator.overlong_buffer')}) "
                          f"must be below orchestrator.max_tokens ({o.max_tokens}): the buffer is the last tokens "
                          f"before the budget")




def _check_pd(cfg: RunConfig, reg: Any, sources: Mapping[str, str]) -> None:
    """Prefill/decode disaggregation's rules that hold for every backend: both pools or
    neither, not mixed with ``replicas``, and a launcher that starts the two pools. How KV
    travels from a prefill to a decode server is the backend's rule (its ``Config.check``)."""
    inf = cfg.inference
    p, d = inf.prefill_replicas, inf.decode_replicas
    if not p and not d:
        return
    if not p or not d:
        given, missing = ("prefill_replicas", "decode_replicas") if p else ("decode_replicas", "prefill_replicas")
        raise ConfigError(
            f"inference.{given} ({p or d}, {origin_of(sources, 'inference.' + given)}) needs "
            f"inference.{missing} too: prefill/decode disaggregation runs both pools (set both, or neither "
            f"for whole-request servers)")
    if not reg.capabilities("launcher", cfg.launcher.name).supports_pd:
        raise ConfigError(
            f"inference.prefill_replicas / decode_replicas ({p} / {d}): launcher.name = {cfg.launcher.name!r} "
            f"({origin_of(sources, 'launcher.name')}) does not start prefill and decode server pools: use "
            f"--inference.replicas there, or a launcher that does (local, slurm)")
    if "inference.replicas" in sources and inf.replicas != 1:
        raise ConfigError(
            f"inference.replicas ({inf.replicas}, {origin_of(sources, 'inference.replicas')}) and "
            f"inference.prefill_replicas / decode_replicas ({p} / {d}) both say how many servers to start: "
            f"with prefill/decode the two pools replace replicas; drop inference.replicas")
