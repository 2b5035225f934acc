"""The bridge to verifiers 0.4's ``verifiers.v1``: environments as the field writes them today.

A v1 environment composes a taskset (tasks with their rewards and metrics), an agent played
by a harness (``null``: the model answers, calling the task's tools if it has any) in a
runtime (``subprocess``: a local process per rollout), and judges. Its training client
renders each turn to token ids with the ``renderers`` package and calls vLLM's token-in
endpoint ``/inference/v1/generate``, which ``primerl inference`` serves on both backends.

So this module, used by :class:`primerl_verifiers.env.VerifiersEnv` when verifiers 0.4 is
installed, loads the environment by id (``--env.id NAME``, ``--env.args.KEY V`` as the
taskset's options, ``env.harness``, ``env.runtime``, ``env.max_turns``; ``null`` in the
subprocess runtime is :mod:`primerl_null`, its program run in the worker), runs each group as
``n`` slots of its task with verifiers' own train client against primerl's inference
(renderer chosen per model, ``env.renderer`` to override), and turns every trace into a
primerl :class:`~primerl.envs.agent.Episode` token-exact: each of its branches (the path
from the first message to a leaf) is the token ids the engine ran, and each run of sampled
tokens on it (the renderer's mask) is one model call, so the episode trains as one sample
per branch whose loss mask is exactly the sampled spans, with the engine's logprobs.

The renderer needs the served model's tokenizer folder: the checkpoint's
(``Endpoint.tokenizer``), or for a preset primerl's byte tokenizer, saved once per worker
(rendered by :class:`primerl_verifiers.renderer.ByteRenderer`, as is a tiny checkpoint).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Iterable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from primerl.envs import Task
from primerl.envs.agent import Endpoint, Episode, ModelCall
from primerl.samples import NO_VERSION

API_KEY_VAR = "PRIMERL_API_KEY"  # where verifiers' client reads the servers' key: primerl's own variable for it
IN_WORKER = "primerl-null"  # the null harness run in the env worker (the primerl_null package)
BYTE = "primerl-byte"  # env.renderer's name for primerl's byte tokenizer's renderer
# renderers' names for the model types primerl serves (its auto resolution matches Hub ids
# only, never a checkpoint folder)
RENDERER_BY_MODEL_TYPE = {
    "glm_moe_dsa": "glm-5", "deepseek_v3": "kimi-k2", "kimi_k2": "kimi-k2", "minimax_m2": "minimax-m2",
    "nemotron_h": "nemotron-3", "qwen3": "qwen3", "qwen3_moe": "qwen3",
}


def installed() -> bool:
    """Whether the installed verifiers is 0.4 or later, whose whole stack is ``verifiers.v1``
    (0.3 ships an early ``verifiers.v1`` beside its classic API, which the bridge uses there)."""
    try:
        release = version("verifiers")
    except PackageNotFoundError:
        return False
    parts = release.split(".")
    return len(parts) >= 2 and parts[0].isdigit() and parts[1].isdigit() and (int(parts[0]), int(parts[1])) >= (0, 4)


def check_renderer(name: str) -> None:
    """``env.renderer`` names a renderer renderers knows (or primerl's byte one); a no-op
    where renderers is not installed (verifiers 0.3)."""
    if not name or name == BYTE:
        return
    try:
        import renderers
    except ImportError:
        return
    try:
        renderers.config_from_name(name)
    except ValueError as exc:
        known = str(exc).partition("Known: ")[2].strip("[]").replace("'", "")
        raise ValueError(f"renderer: renderers has no renderer {name!r}; name one of {known}, {BYTE} (or leave "
                         f"it empty to choose by model)") from None


def calls_of_branch(token_ids: list[int], sampled: list[bool], logprobs: list[float]) -> list[ModelCall]:
    """A branch's model calls: each maximal run ``[a, b)`` of sampled tokens is one call whose
    prompt is everything before it (so each call extends the previous one)."""
    calls, i, n = [], 0, len(token_ids)
    while i < n:
        if not sampled[i]:
            i += 1
            continue
        j = i
        while j < n and sampled[j]:
            j += 1
        calls.append(ModelCall(prompt_ids=list(token_ids[:i]), completion_ids=list(token_ids[i:j]),
                               logprobs=[float(x) for x in logprobs[i:j]], versions=[NO_VERSION] * (j - i)))
        i = j
    return calls


def episodes_of(episode: Any) -> list[Episode]:
    """A v1 episode's traces (one per agent) as primerl episodes, token-exact: each trainable
    branch's sampled runs are its calls (``interleave`` makes each branch one sample)."""
    out = []
    for trace in episode.traces:
        calls = [c for b in trace.branches if b.trainable
                 for c in calls_of_branch(b.token_ids, b.sampled_mask, b.logprobs)]
        metrics = {k: float(v) for k, v in trace.metrics.items() if isinstance(v, int | float)}
        errors = [*trace.errors] if episode.ok else [*episode.errors, *trace.errors]
        out.append(Episode(calls=calls, reward=float(trace.reward), metrics=metrics, error=_errors(errors)))
    if not out and episode.errors:  # it failed before any agent ran
        out.append(Episode(calls=[], reward=0.0, error=_errors(episode.errors)))
    return out


def harness_id(config: Any) -> str:
    """The harness verifiers loads: ``null`` in the subprocess runtime is :mod:`primerl_null`
    (its chat program awaited in the env worker, no process per rollout) unless
    ``env.in_process`` is off; any other harness as named."""
    if config.harness == "null" and config.runtime == "subprocess" and config.in_process:
        return IN_WORKER
    return config.harness


def _check_installed(key: str, ident: str) -> None:
    """``env.id`` names an installed taskset, ``env.harness`` a harness: else one line saying so."""
    from verifiers.v1.utils.loaders import builtin_harness_ids, import_harness, import_taskset

    kind = "taskset" if key == "id" else "harness"
    try:
        (import_taskset if key == "id" else import_harness)(ident)
    except ModuleNotFoundError as exc:
        missing = exc.__cause__.name if isinstance(exc.__cause__, ModuleNotFoundError) else None
        module = ident.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()  # verifiers' own rule
        if missing and module not in missing.split("."):  # it is installed, a module it imports is not
            raise ValueError(f"env.{key}: the verifiers {kind} {ident!r} imports {missing!r}, which is not installed; "
                             f"pip install it") from None
        fix = ("pip install it (e.g. pip install -e examples/verifiers-v1-env for vf-reverse-v1), or fix --env.id"
               if key == "id" else f"name one of {', '.join(builtin_harness_ids())} (or pip install its package)")
        raise ValueError(f"env.{key}: verifiers finds no {kind} {ident!r} installed; {fix}") from None


def _ensure_uv(required: bool = True) -> None:
    """The subprocess runtime runs verifiers' harness programs with ``uv`` found on ``PATH``
    (else it tries to download uv from astral.sh, which fails offline). A venv used without
    being activated (``/path/venv/bin/primerl run``) has uv in its scripts folder but not on
    ``PATH``: put that folder first, as activating it would; no uv anywhere is one line
    where the harness ``required`` it."""
    scripts = sysconfig.get_path("scripts")
    if shutil.which("uv") is None and shutil.which("uv", path=scripts):
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
    if required and shutil.which("uv") is None:
        raise ValueError(f"env.runtime: verifiers' subprocess runtime runs its harness with uv, which is not "
                         f"installed; {sys.executable} -m pip install uv")


def _config_key(loc: tuple[Any, ...]) -> str:
    """primerl's ``[env]`` key for where verifiers' config validation failed."""
    head, rest = (loc[0], loc[1:]) if loc else ("", ())
    if head == "taskset":
        return "env.args." + ".".join(map(str, rest)) if rest else "env.args"
    if head == "agent" and rest and rest[0] in ("harness", "runtime", "max_turns"):
        return f"env.{rest[0]}"
    return "env.args"


def _errors(errors: list[Any]) -> str | None:
    """verifiers ``Error``s as one line each (type: first line of the message)."""
    lines = [f"{e.type}: {e.message.strip().splitlines()[0][:300]}" if e.message.strip() else e.type for e in errors]
    return "; ".join(lines) or None


class V1Bridge:
    """One process's v1 environment (loaded on first use) and the groups it runs."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self._env: Any = None
        self._tasks: dict[str, Any] | None = None
        self._serving: contextlib.AsyncExitStack | None = None
        self._byte_tokenizer: str | None = None

    @property
    def env(self) -> Any:
        if self._env is None:
            os.environ.setdefault("VF_LOG_LEVEL", "WARNING")
            import verifiers.v1 as vf
            from pydantic import ValidationError

            c = self.config
            _check_installed("id", c.id)
            _check_installed("harness", c.harness)
            harness = harness_id(c)
            if c.runtime == "subprocess":  # primerl-null launches with uv only where its program needs a process
                _ensure_uv(required=harness != IN_WORKER)
            spec = {"taskset": {"id": c.id, **c.args},
                    "agent": {"harness": {"id": harness}, "runtime": {"type": c.runtime}, "max_turns": c.max_turns}}
            try:
                self._env = vf.load_environment(vf.resolve_env_config(spec))
            except ValidationError as exc:  # a taskset option, the runtime or the harness' own
                error = exc.errors()[0]
                key = _config_key(error["loc"])
                raise ValueError(f"{key}: {error['msg']} (verifiers environment {c.id!r}); fix --{key}") from None
            if self._env.taskset.INFINITE:
                raise ValueError(f"env.id: the v1 taskset {c.id!r} is infinite and primerl samples from a finite "
                                 f"task list; bound it with its own options (--env.args.*)")
        return self._env

    def _task_map(self) -> dict[str, Any]:
        if self._tasks is None:
            self._tasks = {t.key: t for t in self.env.taskset}
        return self._tasks

    def tasks(self, split: str) -> Iterable[Task]:
        if split != "train":  # a v1 taskset is one list; evaluate it with [[orchestrator.eval_sources]]
            return
        for i, (key, t) in enumerate(self._task_map().items()):
            data = t.data
            # the messages the harness opens with (so an [sft] warm-up renders what the model sees)
            prompt: str | list[dict[str, Any]] = (
                data.prompt if isinstance(data.prompt, str) else [m.model_dump(exclude_none=True) for m in data.prompt or []])
            if data.system_prompt:
                user = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
                prompt = [{"role": "system", "content": data.system_prompt}, *user]
            answer = getattr(data, "answer", None)  # a field of the taskset's own TaskData, if it has one
            yield Task(id=f"{self.config.id}/{data.id if data.id is not None else i}", prompt=prompt or "",
                       answer=str(answer) if answer is not None else None, info={"vf_key": key})

    # ---- the renderer ---------------------------------------------------------------------
    def tokenizer_dir(self, endpoint: Endpoint) -> str:
        if endpoint.tokenizer:
            return endpoint.tokenizer
        if self._byte_tokenizer is None:  # a preset: primerl's byte tokenizer, saved once
            from primerl.tokenizer import byte_tokenizer

            folder = tempfile.mkdtemp(prefix="primerl-vf-tokenizer-")
            byte_tokenizer().save_pretrained(folder)
            self._byte_tokenizer = folder
        return self._byte_tokenizer

    def renderer(self, endpoint: Endpoint) -> Any:
        """``env.renderer`` by name; else primerl's byte renderer for the byte tokenizer (a
        preset, or a tiny checkpoint); else the checkpoint's model type's renderer; else
        renderers' own resolution (the default renderer over the chat template)."""
        import renderers

        from primerl_verifiers import renderer as byte

        name = self.config.renderer
        if not name:
            folder = self.tokenizer_dir(endpoint)
            if byte.is_byte_tokenizer(folder):
                name = BYTE
            else:
                with contextlib.suppress(OSError, ValueError):
                    model_type = json.loads((Path(folder) / "config.json").read_text()).get("model_type")
                    name = RENDERER_BY_MODEL_TYPE.get(model_type, "")
        if name == BYTE:
            return renderers.CustomRendererConfig(import_path=byte.IMPORT_PATH)
        return renderers.config_from_name(name) if name else renderers.AutoRendererConfig()

    # ---- a group --------------------------------------------------------------------------
    async def run_group(self, task: Task, endpoint: Endpoint, n: int) -> list[Episode]:
        import verifiers.v1 as vf

        env = self.env
        v1_task = self._task_map().get(task.info["vf_key"])
        if v1_task is None:
            raise ValueError(f"task {task.id}: the taskset {self.config.id!r} loads other tasks in this process than "
                             f"in the orchestrator's; seed its randomness (--env.args.*)")
        if self._serving is None:  # the env's servers (interception, shared tools), for the worker's life
            self._serving = contextlib.AsyncExitStack()
            await self._serving.enter_async_context(env.serving())
        if endpoint.api_key:  # verifiers' client reads it by name (unset: it sends "EMPTY")
            os.environ[API_KEY_VAR] = endpoint.api_key
        client = vf.TrainClientConfig(base_url=endpoint.base_url, api_key_var=API_KEY_VAR,
                                      renderer=self.renderer(endpoint), renderer_model_name=self.tokenizer_dir(endpoint))
        ctx = vf.ModelContext(model=endpoint.model, client=client,
                              sampling=vf.SamplingConfig(temperature=endpoint.temperature, top_p=endpoint.top_p,
                                                         max_tokens=endpoint.max_tokens))
        episodes = await asyncio.gather(*(env.run_slot(slot, ctx) for slot in env.slots(v1_task, n)))
        return [ep for episode in episodes for ep in episodes_of(episode)]

    async def aclose(self) -> None:
        if self._serving is not None:
            await self._serving.aclose()
            self._serving = None
        if "primerl_null" in sys.modules:  # the in-worker program's HTTP client on this loop
            await sys.modules["primerl_null"].aclose()
