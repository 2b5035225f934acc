"""The bridge to verifiers 0.4's ``verifiers.v1``: environments as the field writes them today.

A v1 environment composes a taskset (tasks with their rewards and metrics), an agent played
by a harness (``null``: the model answers, calling the task's tools if it has any) in a
runtime (``subprocess``: a local process per rollout), and judges. Training clients render
each turn to token ids with the ``renderers`` package and call vLLM's token-in endpoint
``/inference/v1/generate``, which ``primerl inference`` serves on both backends.

So this module, used by :class:`primerl_verifiers.env.VerifiersEnv` when ``verifiers.v1``
is installed, loads the environment by id (``--env.id NAME``, ``--env.args.KEY V`` as the
taskset's options, ``env.harness``, ``env.runtime``, ``env.max_turns``), runs each group as
``n`` slots of its task with verifiers' own train client against primerl's inference
(renderer chosen per model, ``env.renderer`` to override), and turns every trace into a
primerl :class:`~primerl.envs.agent.Episode` token-exact: each of its branches (the path from
the first message to a leaf) is the token ids the engine ran, and each run of sampled tokens
on it (the renderer's mask) is one model call, so the episode trains as one sample per
branch whose loss mask is exactly the sampled spans, with the engine's logprobs.

The renderer needs the served model's tokenizer folder: the checkpoint's
(``Endpoint.tokenizer``), or for a preset primerl's byte tokenizer, saved once per worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from primerl.envs import Task
from primerl.envs.agent import Endpoint, Episode, ModelCall
from primerl.samples import NO_VERSION

API_KEY_VAR = "PRIMERL_VF_API_KEY"  # what verifiers' client reads the servers' key from (this worker's only)
# renderers' names for the model types primerl serves (renderers.MODEL_RENDERER_MAP keys are Hub ids)
RENDERER_BY_MODEL_TYPE = {
    "glm_moe_dsa": "glm-5", "deepseek_v3": "kimi-k2", "minimax_m2": "minimax-m2", "nemotron_h": "nemotron-3",
    "qwen3": "qwen3", "qwen3_moe": "qwen3", "gpt_oss": "gpt-oss", "llama": "llama-3",
}


def installed() -> bool:
    """Whether the installed verifiers is 0.4 or later, whose whole stack is ``verifiers.v1``
    (0.3 ships an early ``verifiers.v1`` beside its classic API, which the bridge uses there)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        release = version("verifiers")
    except PackageNotFoundError:
        return False
    parts = [int(p) for p in release.split(".")[:2] if p.isdigit()]
    return tuple(parts) >= (0, 4)


def calls_of_branch(token_ids: list[int], sampled: list[bool], logprobs: list[float]) -> list[ModelCall]:
    """A branch's model calls: each maximal run ``[a, b)`` of sampled tokens is one call whose
    prompt is everything before it (so consecutive calls extend each other)."""
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


def _errors(items: Iterable[Any]) -> str | None:
    messages = [str(getattr(e, "message", e)) for e in items]
    return "; ".join(m.splitlines()[0][:300] for m in messages if m) or None


class V1Bridge:
    """One env worker's v1 environment, loaded on first use, and its groups."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self._env: Any = None
        self._tasks: list[Any] | None = None
        self._serving: contextlib.AsyncExitStack | None = None
        self._byte_tokenizer: str | None = None

    @property
    def env(self) -> Any:
        if self._env is None:
            import verifiers.v1 as vf

            c = self.config
            spec = {"taskset": {"id": c.id, **c.args},
                    "agent": {"harness": {"id": c.harness}, "runtime": {"type": c.runtime}, "max_turns": c.max_turns}}
            try:
                self._env = vf.load_environment(vf.resolve_env_config(spec))
            except (ImportError, ModuleNotFoundError) as exc:
                raise ValueError(f"verifiers could not load environment {c.id!r} ({exc}): install it (pip install -e "
                                 f"DIR, or from the hub), or fix --env.id") from None
        return self._env

    def task_list(self) -> list[Any]:
        if self._tasks is None:
            self._tasks = list(self.env.taskset)
        return self._tasks

    def tasks(self, split: str) -> Iterable[Task]:
        if split != "train":  # a v1 taskset is one list of tasks; evaluate it as an eval source
            return
        for i, t in enumerate(self.task_list()):
            data = t.data
            answer = getattr(data, "answer", None)
            yield Task(id=f"{self.config.id}/{data.id if data.id is not None else i}", prompt=data.prompt or "",
                       answer=str(answer) if answer is not None else None, info={"vf_index": i})

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
        """``env.renderer`` by name, else the model type's renderer, else the default renderer
        over the tokenizer's chat template (Hermes-style ``<tool_call>`` blocks parsed as
        primerl's byte tokenizer writes them)."""
        import renderers

        name = self.config.renderer
        if not name and endpoint.tokenizer:
            config = Path(endpoint.tokenizer) / "config.json"
            with contextlib.suppress(OSError, ValueError):
                name = RENDERER_BY_MODEL_TYPE.get(json.loads(config.read_text()).get("model_type"), "")
        if name and name != "default":
            return renderers.config_from_name(name)
        return renderers.DefaultRendererConfig(tool_parser="qwen3")

    # ---- a group --------------------------------------------------------------------------
    async def run_group(self, task: Task, endpoint: Endpoint, n: int) -> list[Episode]:
        import verifiers.v1 as vf

        env = self.env
        if self._serving is None:  # the env's servers (interception, shared tools), for the worker's life
            self._serving = contextlib.AsyncExitStack()
            await self._serving.enter_async_context(env.serving())
        os.environ[API_KEY_VAR] = endpoint.api_key or "primerl"
        client = vf.TrainClientConfig(base_url=endpoint.base_url, api_key_var=API_KEY_VAR,
                                      renderer=self.renderer(endpoint), renderer_model_name=self.tokenizer_dir(endpoint))
        ctx = vf.ModelContext(model=endpoint.model, client=client,
                              sampling=vf.SamplingConfig(temperature=endpoint.temperature, top_p=endpoint.top_p,
                                                         max_tokens=endpoint.max_tokens))
        v1_task = self.task_list()[task.info["vf_index"]]
        episodes = await asyncio.gather(*(env.run_slot(slot, ctx) for slot in env.slots(v1_task, n)))
        return [ep for episode in episodes for ep in self.episodes(episode)]

    @staticmethod
    def episodes(episode: Any) -> list[Episode]:
        """A v1 episode's traces (one per agent) as primerl episodes, token-exact."""
        out = []
        for trace in episode.traces:
            calls = [c for b in trace.branches for c in calls_of_branch(list(b.token_ids), list(b.sampled_mask),
                                                                         list(b.logprobs))]
            metrics = {k: float(v) for k, v in (trace.metrics or {}).items() if isinstance(v, int | float)}
            error = _errors([*episode.errors, *trace.errors]) if not (episode.ok and trace.ok) else None
            out.append(Episode(calls=calls, reward=float(trace.reward or 0.0), metrics=metrics, error=error))
        if not out and episode.errors:
            out.append(Episode(calls=[], reward=0.0, error=_errors(episode.errors)))
        return out

    async def aclose(self) -> None:
        if self._serving is not None:
            await self._serving.aclose()
