"""The run's configuration: the sections composed into :class:`RunConfig`, loaded from TOML
files merged left to right, then dotted command-line overrides.

    primerl run --model glm5 --env reverse-text @ base.toml @ fast.toml --trainer.lr 3e-4

Each contract owns its section, beside its Protocol and capability record:
``[model]`` (:class:`primerl.models.ModelConfig`), ``[env]`` (:class:`primerl.envs.EnvConfig`),
``[inference]`` (:class:`primerl.inference.InferenceConfig`), ``[trainer.parallel]``
(:class:`primerl.parallel.ParallelConfig`), ``[launcher]``
(:class:`primerl.launchers.LauncherConfig`), ``[monitors.<name>]``
(:class:`primerl.monitors.MonitorConfig`). The sections only the run itself has (trainer,
orchestrator, sft, watchdog) are defined here, and :class:`RunConfig` composes them all.

A plugin section is checked by the selected plugin's own ``Config`` (a subclass of the
section's class: a third-party env or backend declares its options once and gets the same
checks and error messages), which :mod:`primerl.sections` finds. Tables become attrs classes
through :mod:`primerl.structuring`: errors name the key path, where the value came from
(file or command line) and what is allowed; the CLI prints them and exits with code 2,
without a traceback. Loading imports no component: :mod:`primerl.preflight` builds what the
config names (losses, corrections, advantages, the model's capabilities) to check it.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import attrs

from primerl.envs import EnvConfig, Environment
from primerl.errors import ConfigError, PluginError, PrimerlError
from primerl.inference import InferenceConfig
from primerl.launchers import LauncherConfig
from primerl.models import ModelConfig, plugin_for_model_type
from primerl.models.sources import is_checkpoint_name, model_type_of, packaged
from primerl.monitors import MonitorConfig, with_always_on
from primerl.parallel import ParallelConfig
from primerl.registry import get_registry
from primerl.sections import config_class, fit_section, section_class
from primerl.structuring import first_origin_under as _first_source_under
from primerl.structuring import origin_of as _src
from primerl.structuring import structure
from primerl.validators import non_negative, positive

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["CLI", "ConfigSources", "EvalSourceConfig", "LoraConfig", "OrchestratorConfig", "RunConfig", "SftConfig",
           "SourceConfig", "TrainerConfig", "WatchdogConfig", "build_raw", "dump_toml", "load_config", "merge_into",
           "parse_value", "read_toml", "set_dotted", "source_name_for", "split_args", "to_dict"]


# the sections whose class the plugin a key selects picks: section -> (key, kind, base class)
PLUGIN_SECTIONS = {"model": ("model.name", "model", ModelConfig), "env": ("env.name", "env", EnvConfig),
                   "inference": ("inference.backend", "inference_backend", InferenceConfig),
                   "launcher": ("launcher.name", "launcher", LauncherConfig)}


# --------------------------------------------------------------------------------------
# Sections only the run has; RunConfig composes them with the contracts' sections.
# --------------------------------------------------------------------------------------


@attrs.define(kw_only=True)
class LoraConfig:
    """The ``[trainer.lora]`` section: train low-rank adapters of the model's linears instead
    of its weights (:mod:`primerl.lora`); inference serves the merged weights, checkpoints
    hold the adapter in PEFT's format."""

    # the adapters' rank; 0: LoRA off, every weight trains
    rank: int = attrs.field(default=0, validator=non_negative)
    # the update is scaled by alpha / rank
    alpha: float = attrs.field(default=16.0, validator=positive)
    # the modules adapted, by the last part of their names (q_proj, o_proj, gate_proj...;
    # "experts": the routed experts, one adapter per expert; lm_head: the output head);
    # empty: every linear but the routers (the head unless tied to the embeddings), and
    # the routed experts
    target_modules: list[str] = attrs.Factory(list)


@attrs.define(kw_only=True)
class TrainerConfig:
    """The ``[trainer]`` section: optimisation and weight publishing."""

    lr: float = attrs.field(default=1e-3, validator=positive)  # AdamW's learning rate after warm-up
    # AdamW's decoupled weight decay, on matrices only (not norms or biases); the SFT
    # warm-up uses it too
    weight_decay: float = attrs.field(default=0.0, validator=non_negative)
    # gradients are clipped to this global L2 norm (over every shard) before each step
    max_grad_norm: float = attrs.field(default=1.0, validator=positive)
    # optimizer steps of linear LR warm-up, from lr / warmup_steps up to lr (0 = none)
    warmup_steps: int = attrs.field(default=0, validator=non_negative)
    # the LR after warm-up: "constant", or a "cosine" or "linear" decay to 0 at max_steps
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    # tokens per packed training row; every sample (prompt + completion) must fit in one
    seq_len: int = attrs.field(default=2048, validator=positive)
    # packed rows per forward: gradients accumulate over a step's forwards, so this trades
    # memory for speed and leaves the update unchanged
    micro_batch_rows: int = attrs.field(default=8, validator=positive)
    # samples with the same prompt (a GRPO group) run it once: the prompt's positions are
    # packed once per row with each sample's own positions branching off it (a prompt tree),
    # the same logprobs and gradients for fewer positions. Off for models with recurrent
    # (Mamba) layers, which pack every sample whole
    share_prompts: bool = True
    # the RL loss (register_losses, or a "module:factory"): default (DPPO masking + log-ratio
    # KL), grpo_clip, dapo, dr_grpo, gspo, cispo, sapo, ipo; docs/algorithms.md
    loss: str = "default"
    # the loss's own options, e.g. [trainer.loss_options] clip_high = 0.28 (docs/algorithms.md)
    loss_options: dict[str, Any] = attrs.field(factory=dict)
    # an off-policy correction of the engine/trainer mismatch (register_corrections): tis,
    # mis, icepop; "" = none (the loss's ratio against the engine's logprobs corrects alone)
    correction: str = ""
    # the correction's options, e.g. [trainer.correction_options] cap = 2.0
    correction_options: dict[str, Any] = attrs.field(factory=dict)
    # R3, rollout routing replay: MoE layers send each token to the experts inference chose,
    # so trainer and engine compute the same function (needs the engine's routed experts)
    router_replay: bool = False
    # per-layer routing agreement with inference (needs the engine's routed experts, which
    # the orchestrator then requests for every sample)
    routing_metrics: bool = True
    # aux-loss-free MoE load balancing: per-step move of the routers' correction bias
    # (DeepSeek-V3 uses 1e-3 in pretraining; 0 leaves a pretrained model's routing alone)
    router_bias_update_rate: float = attrs.field(default=0.0, validator=non_negative)
    # steps between resumable checkpoints under checkpoints/ (weights, optimizer, scheduler,
    # RNG, the orchestrator's data position); 0 = only at the end. The same command run again
    # into the same output_dir resumes from the newest usable one
    checkpoint_every: int = attrs.field(default=25, validator=non_negative)
    # the newest checkpoints kept (older ones are deleted once a new one is complete); 0 = all
    keep_checkpoints: int = attrs.field(default=3, validator=non_negative)
    # how weights reach inference: "filesystem" (HF checkpoints in the run directory, any
    # node), "shm" (/dev/shm, servers on the trainer's machine adopt them without a copy)
    # or "nccl" (broadcast from the trainer's GPU to vLLM's workers; GPUs and the vllm backend)
    weight_channel: Literal["filesystem", "shm", "nccl"] = "filesystem"
    # the parallelism plugin that lays the model out over the trainer's processes
    # (primerl.parallel.Parallelism): "auto" is "single" (one process, nothing sharded)
    # for one rank and "fsdp" (FSDP2 with expert and context parallel) for more
    parallelism: str = "auto"
    # trainer processes (ranks) per node, started with torchrun when more than one; on
    # GPUs usually one per GPU
    nproc: int = attrs.field(default=1, validator=positive)
    # CPU threads of the trainer (its ranks split them); 0: its share of the cores (with
    # three roles on one machine, half of them). More than its share overlaps the cores the
    # engine leaves idle (worth it on matmul-bound models: bench/utilisation.py); the
    # launcher then makes idle OpenMP threads sleep instead of spin (OMP_WAIT_POLICY)
    threads: int = attrs.field(default=0, validator=non_negative)
    # where the trainer runs: "auto" is CUDA when present (bf16 compute, fp32 master
    # weights), else the CPU (fp32)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # block-scaled FP8 matmuls, the DeepSeek-V3 recipe (weights in 128x128 blocks,
    # activations in 1x128 tiles, e4m3, fp32 scales); routers, norms, embeddings and the
    # head stay high precision. Emulated with torch's float8 dtypes on CPU.
    fp8: bool = False
    # the dtype the trainer's matmuls compute in (torch.autocast): "auto" is "bfloat16" on
    # CUDA and "float32" on the CPU; "bfloat16" on a CPU pays where it has bf16 instructions
    # (AVX512-BF16, AMX). Master weights, optimizer state, routers, norms, the head and the
    # loss stay float32 either way. With the fsdp strategy on CUDA, FSDP2 computes in bf16.
    precision: Literal["auto", "float32", "bfloat16"] = "auto"
    parallel: ParallelConfig = attrs.field(factory=lambda: ParallelConfig())  # [trainer.parallel]: the device mesh
    lora: LoraConfig = attrs.field(factory=lambda: LoraConfig())  # [trainer.lora]: low-rank adapters

    def resolved_parallelism(self, world_size: int | None = None) -> str:
        """The strategy ``parallelism`` names: ``auto`` is ``single`` for one rank with the
        default layout, else ``fsdp``. ``world_size``: the trainer's ranks over all its nodes
        (``RunConfig.trainer_world_size()``; None: ``nproc``, one node)."""
        if self.parallelism != "auto":
            return self.parallelism
        ranks = self.nproc if world_size is None else world_size
        return "single" if ranks == 1 and self.parallel.is_trivial() else "fsdp"

    def resolved_device(self) -> str:
        """``device``, with ``auto`` resolved: CUDA when torch sees a GPU."""
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_precision(self) -> str:
        """``precision``, with ``auto`` resolved: bfloat16 on CUDA, else float32."""
        if self.precision != "auto":
            return self.precision
        return "bfloat16" if self.resolved_device() == "cuda" else "float32"

    def precision_problem(self, device: str, world_size: int | None = None) -> str | None:
        """Why ``precision`` cannot hold on ``device`` (for ``world_size`` ranks), or None."""
        if self.precision != "float32" or device != "cuda":
            return None
        from primerl.registry import get_registry

        strategy = self.resolved_parallelism(world_size)
        if not get_registry().capabilities("parallelism", strategy).float32_on_cuda:
            return (f"trainer.precision = 'float32' with the {strategy} strategy on CUDA: it computes in bfloat16 "
                    "there (float32 master weights and gradient reductions); set --trainer.precision auto or bfloat16")
        return None


def source_name_for(env_name: str) -> str:
    """The source name an env given alone (``--env NAME`` or ``PLUGIN:NAME``) trains under:
    the env's name without the plugin that was picked, other characters a metric name
    cannot hold turned into '-' (``acme:my env`` -> ``my-env``)."""
    bare = env_name.rpartition(":")[2] or env_name
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", bare).lstrip("-_.")
    return name or "env"


def _source_name(_inst: Any, _attr: attrs.Attribute, value: str) -> None:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", value or ""):
        raise ValueError(f"name: {value!r} must be letters, digits, '_', '.' or '-' (it names the source's metrics, "
                         f"reward/<name>/mean)")


@attrs.define(kw_only=True)
class SourceConfig:
    """One ``[[orchestrator.sources]]`` entry: an environment whose tasks train in every
    batch, ``ratio`` of it (the ratios are of samples). ``env`` is an ``[env]`` table:
    its ``name`` and that env's own options."""

    name: str = attrs.field(validator=_source_name)  # names its metrics: reward/<name>/mean
    env: EnvConfig = attrs.field(factory=lambda: EnvConfig())  # the env and its options, as [env] takes them
    ratio: float = attrs.field(default=1.0, validator=positive)  # its share of every batch's samples
    group_size: int = attrs.field(default=0, validator=non_negative)  # samples per task; 0: orchestrator.group_size
    advantage: str = ""  # its advantage estimator; "": orchestrator.advantage
    advantage_options: dict[str, Any] = attrs.field(factory=dict)  # its estimator's options (with its own advantage)


@attrs.define(kw_only=True)
class EvalSourceConfig:
    """One ``[[orchestrator.eval_sources]]`` entry: an environment evaluated on its own
    interval (each of its first ``tasks`` eval tasks once, at ``orchestrator.eval_temperature``),
    logged as ``eval/<name>/reward/mean``."""

    name: str = attrs.field(validator=_source_name)
    env: EnvConfig = attrs.field(factory=lambda: EnvConfig())
    every: int = attrs.field(default=10, validator=positive)  # batches between its evaluations
    tasks: int = attrs.field(default=64, validator=positive)
    split: str = "eval"  # the env's task split it evaluates


@attrs.define(kw_only=True)
class OrchestratorConfig:
    """The ``[orchestrator]`` section: rollouts, advantages, batches, staleness."""

    # samples per trainer step (one rollout batch); a multiple of group_size
    batch_size: int = attrs.field(default=64, validator=positive)
    # samples per prompt: the group whose rewards each advantage is relative to
    group_size: int = attrs.field(default=8, validator=positive)
    max_tokens: int = attrs.field(default=64, validator=positive)  # most tokens sampled per model turn
    # sampling temperature of the training rollouts (0 = greedy)
    temperature: float = attrs.field(default=1.0, validator=non_negative)
    # nucleus sampling: only the most likely tokens holding this much probability; in (0, 1], 1 = off
    top_p: float = 1.0
    # samples in flight at once (whole groups are started, at least one)
    max_concurrent: int = attrs.field(default=256, validator=positive)
    # processes running multi-turn and agent env code, so a hung or crashed env costs one group
    env_workers: int = attrs.field(default=4, validator=positive)
    # how far generation runs ahead of training: with inference at policy version v, groups
    # of batches up to v + 1 + async_level may start (0 = synchronous, on-policy)
    async_level: int = attrs.field(default=1, validator=non_negative)
    # samples whose oldest token is more than this many policy versions older than their
    # batch's (n - 1 for batch n) are dropped, counted in dropped_stale; >= async_level
    max_off_policy_steps: int = attrs.field(default=8, validator=non_negative)
    # the advantage estimator (register_advantages, or a "module:factory"): grpo (reward
    # minus the group mean), grpo_std (divided by the group's std), rloo, reinforce_pp
    advantage: str = "grpo"
    # the estimator's own options, e.g. [orchestrator.advantage_options]
    advantage_options: dict[str, Any] = attrs.field(factory=dict)
    # DAPO's dynamic sampling: a group whose rewards are all equal (no signal for a
    # group-relative advantage) is skipped and a fresh one takes its place, counted in
    # skipped_uniform (at most 4 batches' worth per batch, so an all-zero start still trains)
    skip_uniform_groups: bool = False
    # DAPO's soft overlong punishment: a model turn within this many tokens of max_tokens
    # loses up to overlong_penalty of reward for the advantage (0 = off)
    overlong_buffer: int = attrs.field(default=0, validator=non_negative)
    # the most reward a turn that reaches max_tokens loses (linear over the buffer)
    overlong_penalty: float = attrs.field(default=1.0, validator=non_negative)
    # stop the run when this many rollout groups fail in a row with none succeeding in
    # between: the env cannot run its tasks (a missing sandbox, a broken harness)
    max_failed_groups: int = attrs.field(default=16, validator=positive)
    # evaluation on the env's "eval" split every eval_every batches (0 = never): each task
    # once at eval_temperature (0 = greedy), logged as eval/* with the batch after it ends
    eval_every: int = attrs.field(default=0, validator=non_negative)
    eval_tasks: int = attrs.field(default=64, validator=positive)  # evaluate the eval split's first this many tasks
    # sampling temperature of evaluations (0 = greedy)
    eval_temperature: float = attrs.field(default=0.0, validator=non_negative)
    # episodes per eval task: the mean reward is over all of them, pass@k reported up to this
    eval_samples: int = attrs.field(default=1, validator=positive)
    # several environments trained together ([[orchestrator.sources]]: name, env, ratio,
    # group_size, advantage), mixed in every batch by ratio; empty: [env] alone (--env is
    # the short form of one source)
    sources: list[SourceConfig] = attrs.Factory(list)
    # environments evaluated on their own interval ([[orchestrator.eval_sources]]: name,
    # env, every, tasks, split)
    eval_sources: list[EvalSourceConfig] = attrs.Factory(list)

    def train_sources(self, env: EnvConfig) -> list[SourceConfig]:
        """The sources the run trains on, each with its group size and advantage resolved
        (``env``: the run's ``[env]``, the one source when none are listed)."""
        listed = self.sources or [SourceConfig(name=source_name_for(env.name), env=env)]
        return [attrs.evolve(s, group_size=s.group_size or self.group_size, advantage=s.advantage or self.advantage,
                             advantage_options=s.advantage_options if s.advantage else self.advantage_options)
                for s in listed]

    def groups_per_batch(self, env: EnvConfig) -> dict[str, int]:
        """Each source's groups in every batch: its ratio of ``batch_size`` samples, in whole
        groups (the sum must be exactly ``batch_size``: checked at config time)."""
        srcs = self.train_sources(env)
        total = sum(s.ratio for s in srcs)
        return {s.name: max(1, round(self.batch_size * s.ratio / total / s.group_size)) for s in srcs}


@attrs.define(kw_only=True)
class SftConfig:
    """The ``[sft]`` section: supervised warm-up on the env's reference answers before RL.

    A fresh tiny model earns no reward at all; a short warm-up gives RL something to
    improve. ``steps = 0`` skips it (the usual case for a pretrained checkpoint).
    """

    steps: int = attrs.field(default=0, validator=non_negative)  # optimizer steps of the warm-up; 0 = none
    # the warm-up's own AdamW learning rate (constant; trainer.weight_decay and
    # trainer.max_grad_norm apply)
    lr: float = attrs.field(default=3e-3, validator=positive)
    # tasks of the env's train split (cycled) per warm-up step, one reference answer each
    batch_size: int = attrs.field(default=32, validator=positive)


@attrs.define(kw_only=True)
class WatchdogConfig:
    """The ``[watchdog]`` section: a run that makes no progress says where it is stuck
    (:mod:`primerl.watchdog`): every process's waits and Python stacks go to
    ``logs/watchdog.log``, and one line names the stuck stage."""

    # seconds without progress (no rollout, batch or trainer step anywhere) before the
    # watchdog reports; 0: off
    stall_timeout_s: float = attrs.field(default=600.0, validator=non_negative)
    # after the report: "exit" stops the run (exit code 3), "wait" keeps it going and
    # reports again after another stall_timeout_s without progress
    on_stall: str = attrs.field(default="exit", validator=attrs.validators.in_(("exit", "wait")))


@attrs.define(kw_only=True)
class RunConfig:
    """Everything a run needs; written to ``OUTPUT_DIR/config.toml`` for its processes."""

    # the run directory: config, logs, rollouts, weights, checkpoints, metrics
    # (docs/architecture.md); a rerun into it resumes from its newest checkpoint
    output_dir: str = "outputs/run"
    # trainer steps (one rollout batch each); also where a cosine or linear LR decay ends
    max_steps: int = attrs.field(default=100, validator=positive)
    # the run's seed: the trainer's torch and Python RNGs, the order of the env's tasks, vLLM's --seed
    seed: int = 0
    model: ModelConfig = attrs.field(factory=ModelConfig)  # [model]: checked by the model plugin's Config
    env: EnvConfig = attrs.field(factory=EnvConfig)  # [env]: checked by the environment's Config
    inference: InferenceConfig = attrs.field(factory=InferenceConfig)  # [inference]: or the backend's Config
    trainer: TrainerConfig = attrs.field(factory=TrainerConfig)  # [trainer]
    orchestrator: OrchestratorConfig = attrs.field(factory=OrchestratorConfig)  # [orchestrator]
    sft: SftConfig = attrs.field(factory=SftConfig)  # [sft]: the optional warm-up before RL
    launcher: LauncherConfig = attrs.field(factory=LauncherConfig)  # [launcher]
    watchdog: WatchdogConfig = attrs.field(factory=WatchdogConfig)  # [watchdog]: stalls reported, not silent
    # [monitors.<name>]: where each step's metrics go besides metrics.jsonl (wandb,
    # tensorboard...), each checked by its monitor's Config; any key of a table switches its
    # monitor on (docs/monitors.md)
    monitors: dict[str, MonitorConfig] = attrs.Factory(dict)

    def check(self, sources: Mapping[str, str]) -> None:
        """Rules that span fields; each error names the keys involved."""
        o = self.orchestrator
        srcs = o.train_sources(self.env)  # each source built (and validated) as the orchestrator will
        if o.sources:
            names = [s.name for s in srcs]
            if len(set(names)) < len(names):
                raise ConfigError(f"orchestrator.sources: names {names} repeat; give each source its own name")
            quotas = o.groups_per_batch(self.env)
            got = sum(quotas[s.name] * s.group_size for s in srcs)
            if got != o.batch_size:
                parts = ", ".join(f"{s.name}: {quotas[s.name]} groups of {s.group_size}" for s in srcs)
                raise ConfigError(f"orchestrator.sources: their ratios split orchestrator.batch_size "
                                  f"({o.batch_size}) into {parts} = {got} samples; choose batch_size, ratios and "
                                  f"group sizes that give whole groups summing to batch_size")
        elif o.batch_size % o.group_size:
            raise ConfigError(
                f"orchestrator.batch_size ({o.batch_size}, {_src(sources, 'orchestrator.batch_size')}) "
                f"must be a multiple of orchestrator.group_size ({o.group_size}, "
                f"{_src(sources, 'orchestrator.group_size')})"
            )
        if o.async_level > o.max_off_policy_steps:
            raise ConfigError(
                f"orchestrator.async_level ({o.async_level}) cannot exceed "
                f"orchestrator.max_off_policy_steps ({o.max_off_policy_steps}): every batch would "
                f"be dropped as stale. Raise max_off_policy_steps or lower async_level."
            )
        if not 0 < o.top_p <= 1:
            raise ConfigError(f"orchestrator.top_p must be in (0, 1], got {o.top_p}")
        self.trainer.parallel.resolved(self.trainer_world_size())
        if self.trainer.lora.rank and self.trainer.fp8:
            raise ConfigError(f"trainer.lora.rank ({_src(sources, 'trainer.lora.rank')}) with trainer.fp8 "
                              f"({_src(sources, 'trainer.fp8')}): the FP8 matmuls replace the linears the adapters "
                              f"wrap; leave one of them off")
        if self.trainer.device == "cuda" and (problem := self.trainer.precision_problem("cuda", self.trainer_world_size())):
            raise ConfigError(f"{problem} ({_src(sources, 'trainer.precision')})")
        if not _is_loopback(self.inference.host) and not self.inference.resolved_api_key():
            raise ConfigError(
                f"inference.host = {self.inference.host!r} ({_src(sources, 'inference.host')}) exposes the inference "
                f"server (its admin endpoints too) beyond this machine, so it needs an API key: set PRIMERL_API_KEY "
                f"in the environment (or --inference.api_key), or bind 127.0.0.1")

    def trainer_world_size(self) -> int:
        """The trainer's ranks: its nodes (one with the local launcher) x ``trainer.nproc``."""
        return self.trainer.nproc * self.launcher.trainer_nodes_used()


# --------------------------------------------------------------------------------------
# Raw layer: TOML files and overrides merged into one dict, remembering each leaf's origin.
# --------------------------------------------------------------------------------------

CLI = "the command line"


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file '{p}' does not exist (given as '@ {path}')")
    try:
        with p.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file '{p}' is not valid TOML: {exc}") from None


def merge_into(base: dict, new: Mapping, origin: str, sources: dict[str, str], prefix: str = "") -> None:
    """Deep-merge ``new`` into ``base`` (tables merge, other values replace)."""
    for key, value in new.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            merge_into(base[key], value, origin, sources, path + ".")
        elif isinstance(value, Mapping):
            base[key] = {}
            merge_into(base[key], value, origin, sources, path + ".")
        else:
            base[key] = value
            sources[path] = origin


def parse_value(raw: str) -> Any:
    """A CLI value is read as a TOML value when it parses as one, else as a plain string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def set_dotted(data: dict, dotted: str, value: Any, origin: str, sources: dict[str, str]) -> None:
    parts = dotted.split(".")
    if not all(parts):
        raise ConfigError(f"'--{dotted}' is not a valid key path (expected --section.key)")
    nested: dict = value
    for part in reversed(parts):
        nested = {part: nested}
    merge_into(data, nested, origin, sources)


# --------------------------------------------------------------------------------------
# Putting it together
# --------------------------------------------------------------------------------------


@attrs.define
class ConfigSources:
    """Command-line pieces of a config: ``@ file`` arguments and ``--a.b value`` overrides."""

    files: list[str] = attrs.Factory(list)
    overrides: list[tuple[str, str]] = attrs.Factory(list)


def split_args(args: list[str]) -> ConfigSources:
    """Parse the free-form tail of a command line: ``@ a.toml``, ``@b.toml``, ``--k.v x``, ``--k.v=x``."""
    out = ConfigSources()
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "@":
            if i + 1 >= len(args):
                raise ConfigError("'@' must be followed by a TOML file path")
            out.files.append(args[i + 1])
            i += 2
        elif arg.startswith("@"):
            out.files.append(arg[1:])
            i += 1
        elif arg.startswith("--"):
            key, eq, val = arg[2:].partition("=")
            if not eq:
                if i + 1 >= len(args) or (args[i + 1].startswith("--") and not _is_number(args[i + 1])):
                    val = "true"  # a bare flag: --trainer.router_replay
                    i += 1
                else:
                    val = args[i + 1]
                    i += 2
            else:
                i += 1
            out.overrides.append((key.replace("-", "_"), val))
        else:
            raise ConfigError(
                f"unexpected argument '{arg}': use '@ FILE.toml' for config files and "
                f"'--section.key VALUE' for overrides"
            )
    return out


def _is_number(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def build_raw(src: ConfigSources, explicit: Mapping[str, Any] | None = None) -> tuple[dict, dict[str, str]]:
    raw: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for f in src.files:
        merge_into(raw, read_toml(f), f"'{f}'", sources)
    for key, val in src.overrides:
        set_dotted(raw, key, parse_value(val), f"{CLI} (--{key})", sources)
    for key, val in (explicit or {}).items():
        if val is not None:
            set_dotted(raw, key, val, f"{CLI} (--{key.split('.')[0]})", sources)
    return raw, sources


def load_config(src: ConfigSources, explicit: Mapping[str, Any] | None = None, registry: Any = None,
                origins: dict[str, str] | None = None) -> RunConfig:
    """Resolve a RunConfig; plugin sections are checked by the selected plugin's Config class.
    ``origins``, when given, is filled with where each set key came from (key path -> a file,
    the command line, an env's run defaults...)."""
    raw, sources = build_raw(src, explicit)
    if origins is not None:  # the caller's dict, filled as the layers below add theirs
        origins.update(sources)
        sources = origins
    reg = registry or get_registry()
    listed = _take_sources(raw, sources)
    if listed["sources"]:  # the first source's env is the run's [env] (its run defaults, the SFT warm-up)
        first = _source_env(listed["sources"][0], "orchestrator.sources[0]", sources, reg)[0]
        if "env" in raw and raw["env"] != first:  # (a written config.toml holds both)
            raise ConfigError(f"[env] ({_src(sources, 'env.name')}) and [[orchestrator.sources]] both say what to train "
                              f"on: list every environment as a source, or give [env] (--env) alone")
        raw["env"] = _source_env(listed["sources"][0], "orchestrator.sources[0]", sources, reg)[0]
    _model_from_checkpoint(raw, sources, reg)
    # the model and the env are known before the env's run defaults, the backend and launcher after
    plugin_classes = {s: section_class(raw, sources, reg, *PLUGIN_SECTIONS[s]) for s in ("model", "env")}
    raw, suggested = _with_run_defaults(raw, sources, reg)
    plugin_classes |= {s: section_class(raw, sources, reg, *PLUGIN_SECTIONS[s]) for s in ("inference", "launcher")}
    for section, cls in plugin_classes.items():
        fit_section(raw, sources, suggested, reg, *PLUGIN_SECTIONS[section], cls)
    top = {k: v for k, v in raw.items() if k not in plugin_classes and k != "monitors"}
    cfg = structure(RunConfig, top, "", sources)
    cfg.monitors = _structure_monitors(raw.get("monitors", {}), sources, reg)
    for section, cls in plugin_classes.items():
        setattr(cfg, section, structure(cls, raw.get(section, {}), section, sources))
    cfg.orchestrator.sources = [_structure_source(SourceConfig, t, f"orchestrator.sources[{i}]", sources, reg)
                                for i, t in enumerate(listed["sources"])]
    cfg.orchestrator.eval_sources = [
        _structure_source(EvalSourceConfig, t, f"orchestrator.eval_sources[{i}]", sources, reg)
        for i, t in enumerate(listed["eval_sources"])]
    cfg.check(sources)
    return cfg


def _with_run_defaults(raw: dict[str, Any], sources: dict[str, str], reg: Any) -> tuple[dict[str, Any], set[str]]:
    """``raw`` over the run settings the env suggests (``run_defaults``: max_tokens, SFT
    warm-up...; with a pretrained checkpoint its ``pretrained_run_defaults`` on top), which
    sit below every file and flag, and the key paths only they set: a plugin section drops
    those its selected plugin lacks (:func:`primerl.sections.fit_section`)."""
    env_name = raw.get("env", {}).get("name", EnvConfig().name)
    env_cls = reg.load("env", env_name)
    if not (isinstance(env_cls, type) and issubclass(env_cls, Environment)):
        raise ConfigError(f"env plugin '{env_name}' registers {env_cls!r}, which is not a subclass of "
                          "primerl.envs.Environment (SingleTurnEnv, MultiTurnEnv, AgentEnv...); fix the plugin")
    pretrained = isinstance(raw.get("model"), Mapping) and raw["model"].get("checkpoint") is not None
    layers = [(env_cls.run_defaults, f"the run defaults of env '{env_name}'")]
    if pretrained:
        layers.append((env_cls.pretrained_run_defaults,
                       f"the run defaults of env '{env_name}' for a pretrained checkpoint"))
    if not any(d for d, _ in layers):
        return raw, set()
    merged: dict[str, Any] = {}
    default_sources: dict[str, str] = {}
    for defaults, origin in layers:
        merge_into(merged, defaults, origin, default_sources)
    merge_into(merged, raw, "", {})
    suggested = {path for path in default_sources if path not in sources}
    for path, origin in default_sources.items():
        sources.setdefault(path, origin)
    return merged, suggested


def _model_from_checkpoint(raw: dict[str, Any], sources: dict[str, str], reg: Any) -> None:
    """``--model.checkpoint`` without ``--model``: the plugin the checkpoint names (a packaged
    checkpoint's own ``model``), else the one made for its ``model_type``, else ``hf``."""
    table = raw.get("model")
    if not isinstance(table, dict) or "name" in table or not isinstance(table.get("checkpoint"), str):
        return
    value = table["checkpoint"]
    try:
        if is_checkpoint_name(value):
            name, why = packaged(value, reg).model, f"the packaged checkpoint {value!r} names it"
        else:
            model_type = model_type_of(value, reg)
            name = plugin_for_model_type(model_type, reg) or "hf"
            why = f"the checkpoint's model_type is {model_type!r}"
    except PrimerlError:
        return  # the checkpoint's own check names the problem
    table["name"] = name
    sources["model.name"] = f"model.checkpoint ({why})"


def _take_sources(raw: dict[str, Any], sources: Mapping[str, str]) -> dict[str, list[dict[str, Any]]]:
    """``orchestrator.sources`` and ``eval_sources`` out of ``raw`` (each entry's ``env`` is
    checked by its own env's Config, not by the orchestrator section's types)."""
    out: dict[str, list[dict[str, Any]]] = {}
    orch = raw.get("orchestrator")
    for key in ("sources", "eval_sources"):
        value = orch.pop(key, []) if isinstance(orch, dict) else []
        if not isinstance(value, list) or not all(isinstance(t, Mapping) for t in value):
            raise ConfigError(f"orchestrator.{key} ({_src(sources, 'orchestrator.' + key)}) must be a list of tables "
                              f"([[orchestrator.{key}]] entries)")
        out[key] = [dict(t) for t in value]
    return out


def _source_env(table: dict[str, Any], path: str, sources: Mapping[str, str], reg: Any) -> tuple[dict, type]:
    """A source entry's ``env`` table (``env = "wordle"`` is ``{name = "wordle"}``) and the
    Config class of the env it names."""
    env = table.get("env", {})
    if isinstance(env, str):  # env = "wordle": the env's defaults
        env = {"name": env}
    if not isinstance(env, Mapping) or not isinstance(env.get("name"), str):
        raise ConfigError(f"{path}.env ({_src(sources, path + '.env')}) must be a table with the env's name, "
                          f"e.g. env = {{name = \"wordle\"}}")
    label = f"{path}.env.name = {env['name']!r} ({_src(sources, path + '.env.name')})"
    return dict(env), config_class(reg, "env", env["name"], EnvConfig, label=label)


def _structure_source(cls: type, table: dict[str, Any], path: str, sources: Mapping[str, str], reg: Any) -> Any:
    """One source entry, its ``env`` table checked by that env plugin's Config."""
    env, env_cls = _source_env(table, path, sources, reg)
    rest = {k: v for k, v in table.items() if k != "env"}
    out = structure(cls, {**rest, "name": table.get("name", source_name_for(env["name"]))}, path, sources)
    out.env = structure(env_cls, env, f"{path}.env", sources)
    return out


def _structure_monitors(raw: Any, sources: Mapping[str, str], reg: Any) -> dict[str, MonitorConfig]:
    """The ``[monitors.<name>]`` tables, each checked by its monitor's ``Config``: a table with
    any key switches its monitor on unless it says ``enabled = false``. Always-on monitors
    (file) come first, switched on, whether named or not."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"'monitors' ({_src(sources, 'monitors')}) must be a table of tables, one per monitor: "
                          f"e.g. --monitors.wandb.project NAME, or [monitors.tensorboard] enabled = true")
    out: dict[str, MonitorConfig] = {}
    for name, table in raw.items():
        path = f"monitors.{name}"
        where = sources.get(path) or _first_source_under(sources, path) or "the defaults"
        if not isinstance(table, Mapping):
            raise ConfigError(f"{path} (from {where}) must be a table of the monitor's options: "
                              f"--{path}.enabled true switches it on")
        registered = {c.name for c in reg.of_kind("monitor")}
        if name not in registered and name.replace("_", "-") in registered:
            name = name.replace("_", "-")  # --monitors.my-monitor.key: the command line turns '-' into '_'
        cls = config_class(reg, "monitor", name, MonitorConfig, label=f"{path} (from {where})")
        options = structure(cls, table, path, sources)
        caps = reg.capabilities("monitor", name)
        if "enabled" not in table:
            options.enabled = True  # naming a monitor's keys switches it on
        elif not options.enabled and caps.always_on:
            raise ConfigError(f"{path}.enabled = false ({_src(sources, path + '.enabled')}): monitor {name!r} is "
                              f"always on ({caps.why or 'the run needs it'}); drop the key")
        out[name] = options
    try:
        return with_always_on(out, reg)
    except PluginError as exc:
        raise ConfigError(f"monitors: an always-on monitor does not load: {exc}") from None


def to_dict(cfg: Any) -> dict[str, Any]:
    return attrs.asdict(cfg, recurse=True)


def dump_toml(data: Mapping[str, Any]) -> str:
    """Write a nested dict of scalars/lists as TOML (None values are omitted)."""
    lines: list[str] = []

    def scalar(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, int | float):
            return repr(v)
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, list | tuple):
            return "[" + ", ".join(scalar(x) for x in v) + "]"
        if isinstance(v, Mapping):  # an inline table (entries of a list of tables: orchestrator.sources)
            return "{" + ", ".join(f"{k} = {scalar(x)}" for k, x in v.items() if x is not None) + "}"
        raise TypeError(f"cannot write {type(v).__name__} to TOML")

    def table(d: Mapping[str, Any], name: str) -> None:
        simple = [(k, v) for k, v in d.items() if not isinstance(v, Mapping) and v is not None]
        nested = [(k, v) for k, v in d.items() if isinstance(v, Mapping)]
        if name and simple:
            lines.append(f"\n[{name}]")
        for k, v in simple:
            lines.append(f"{k} = {scalar(v)}")
        for k, v in nested:
            table(v, f"{name}.{k}" if name else k)

    table(data, "")
    return "\n".join(lines).lstrip("\n") + "\n"
