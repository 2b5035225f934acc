"""The verifiers bridge on verifiers 0.4 (``verifiers.v1``): the v1 environments of
examples/verifiers-v1-env, written as verifiers' docs show, run by verifiers' own train
client against a real `primerl inference` process. Runs where verifiers 0.4 is installed
(CI: a venv of its own, as docs/environments.md tells a user to make it)."""

import asyncio
import json
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest

pytest.importorskip("verifiers.v1")
pytest.importorskip("vf_reverse_v1")

from conftest import InferenceServer, free_port

from primerl.config import ConfigSources, load_config
from primerl.envs.agent import Endpoint, interleave
from primerl.envs.multiturn import prompt_ids, turn_suffix
from primerl.errors import ConfigError
from primerl.tokenizer import EOS_TOKEN_ID, byte_tokenizer

OBSERVATION = 262  # the byte tokenizer's <|observation|>: a tool result follows


def config(**kw):
    from primerl_verifiers.env import VerifiersConfig

    return VerifiersConfig(**{"name": "verifiers", "id": "vf-reverse-v1", "args": {"num_tasks": 20}, **kw})


@pytest.fixture(scope="module")
def server():
    with InferenceServer("--model", "glm5", "--inference.max_model_len", "512") as s:
        yield s


def endpoint(url, **kw):
    return Endpoint(**{"base_url": url + "/v1", "model": "glm5", "max_tokens": 12, "temperature": 1.0,
                       "max_model_len": 512, **kw})


def scored(server, prompt_ids, completion_ids):
    """The server's own logprobs of ``completion_ids`` after ``prompt_ids`` (a prefill)."""
    body = {"token_ids": prompt_ids + completion_ids, "sampling_params": {"max_tokens": 0, "prompt_logprobs": 0}}
    rows = httpx.post(server.url + "/inference/v1/generate", json=body, timeout=60).json()["prompt_logprobs"]
    return [rows[len(prompt_ids) + i][str(t)]["logprob"] for i, t in enumerate(completion_ids)]


def test_tasks_come_from_the_taskset():
    from primerl_verifiers.env import VerifiersEnv

    tasks = list(VerifiersEnv(config()).tasks("train"))
    assert len(tasks) == 20 and tasks[0].id == "vf-reverse-v1/r0"
    text = tasks[0].prompt.removeprefix("Reverse the text: ")
    assert tasks[0].answer == text[::-1] and text.isalpha()
    assert len({t.info["vf_key"] for t in tasks}) == 20  # one key per task, even where texts repeat
    letters = list(VerifiersEnv(config(args={"num_tasks": 5, "letters": True, "max_len": 4})).tasks("train"))
    assert all(3 <= len(t.answer) <= 4 for t in letters)
    assert list(VerifiersEnv(config()).tasks("eval")) == []  # a v1 taskset has one list


def test_the_renderer_follows_the_model(tmp_path):
    import renderers
    from primerl_verifiers import v1

    bridge = v1.V1Bridge(config())
    preset = endpoint("http://x")
    assert bridge.renderer(preset) == renderers.CustomRendererConfig(import_path="primerl_verifiers.renderer.ByteRenderer")
    assert v1.V1Bridge(config(renderer="qwen3")).renderer(preset) == renderers.Qwen3RendererConfig()
    tiny = tmp_path / "tiny"  # a tiny preset's checkpoint carries the byte tokenizer
    byte_tokenizer().save_pretrained(tiny)
    (tiny / "config.json").write_text(json.dumps({"model_type": "glm_moe_dsa"}))
    assert bridge.renderer(endpoint("http://x", tokenizer=str(tiny))).import_path.endswith("ByteRenderer")
    real = tmp_path / "real"  # another tokenizer: the model type's renderer
    real.mkdir()
    (real / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    for model_type, expected in [("glm_moe_dsa", renderers.GLM5RendererConfig()),
                                 ("qwen3_moe", renderers.Qwen3RendererConfig()),
                                 ("llama", renderers.AutoRendererConfig())]:
        (real / "config.json").write_text(json.dumps({"model_type": model_type}))
        assert bridge.renderer(endpoint("http://x", tokenizer=str(real))) == expected
    with pytest.raises(ValueError, match="renderer: renderers has no renderer 'nope'.*glm-5.*primerl-byte"):
        config(renderer="nope")


def test_the_byte_renderer_parses_tool_calls_and_bridges_turns():
    """Tool calls are the bytes the template writes; a bridged turn is the previous prompt and
    completion exactly, then what primerl's own multi-turn envs append (turn_suffix)."""
    from primerl_verifiers.renderer import ByteRenderer
    from renderers.base import ToolCallParseStatus

    tok = byte_tokenizer()
    r = ByteRenderer(tok)
    enc = lambda s: list(tok.encode(s, add_special_tokens=False))
    call = '<tool_call>{"name": "rev", "arguments": {"text": "ab"}}</tool_call>'
    parsed = r.parse_response(enc("ok " + call + "<tool_call>{bad") + [EOS_TOKEN_ID])
    assert parsed.content == "ok "
    good, bad = parsed.tool_calls
    assert (good.name, good.arguments, good.status) == ("rev", {"text": "ab"}, ToolCallParseStatus.OK)
    assert bad.status == ToolCallParseStatus.UNCLOSED_BLOCK
    messages = [{"role": "user", "content": "reverse ab"}]
    prompt = r.render(messages, add_generation_prompt=True).token_ids
    assert prompt == prompt_ids(tok, messages)
    completion = enc(call) + [EOS_TOKEN_ID]
    new = [{"role": "tool", "content": "ba", "tool_call_id": "call_0"}]
    bridged = r.bridge_to_next_turn(prompt, completion, new)
    history = messages + [{"role": "assistant", "content": call}]
    assert bridged.token_ids == prompt + completion + turn_suffix(tok, history, new)
    assert tok.decode(bridged.token_ids[len(prompt + completion):]) == "<|observation|>\nba<|assistant|>\n"
    start = len(prompt + completion)
    assert bridged.message_token_spans() == [(start, start + len(enc("<|observation|>\nba")))]


@pytest.mark.slow
def test_a_group_is_token_exact_with_the_engines_logprobs(server):
    """Each trace's branch is what the engine ran: the sample's tokens are the branch's, its
    loss mask the sampled spans, its logprobs the server's own scoring of those tokens."""
    from primerl_verifiers.env import VerifiersEnv

    env = VerifiersEnv(config())
    task = next(iter(env.tasks("train")))
    episodes = env.run_group(task, endpoint(server.url), 3)
    assert len(episodes) == 3
    for ep in episodes:
        assert ep.error is None and 0.0 <= ep.reward <= 1.0 and set(ep.metrics) == {"exact"}
        (call,) = ep.calls  # single turn: one model call
        (sample,) = interleave(ep.calls)
        assert sample.tokens == call.prompt_ids + call.completion_ids
        assert sample.loss_mask == [0] * len(call.prompt_ids) + [1] * len(call.completion_ids)
        # the task's messages as primerl renders them (so an [sft] warm-up trains on this prompt)
        assert call.prompt_ids == prompt_ids(byte_tokenizer(), task.messages())
        assert call.logprobs == pytest.approx(scored(server, call.prompt_ids, call.completion_ids), abs=1e-4)
    env.close()


@pytest.mark.slow
def test_the_null_harness_runs_in_the_worker_without_a_process(server):
    """The null harness in the subprocess runtime is primerl-null: its chat program runs in the
    worker, so a group starts no process (no child CPU is reaped) and gives what verifiers'
    own per-rollout launch gives; --env.in_process false launches one per rollout."""
    import resource

    from primerl_null import WorkerNullHarness
    from primerl_verifiers.env import VerifiersEnv
    from verifiers.v1.harnesses.null.harness import NullHarness

    children = lambda: (lambda r: r.ru_utime + r.ru_stime)(resource.getrusage(resource.RUSAGE_CHILDREN))
    results = {}
    for in_process in (True, False):
        env = VerifiersEnv(config(in_process=in_process))
        task = next(iter(env.tasks("train")))
        env.run_group(task, endpoint(server.url), 1)  # the worker's first group loads what it needs
        before = children()
        episodes = env.run_group(task, endpoint(server.url), 4)
        results[in_process] = (children() - before, episodes, type(env._v1.env._harnesses["agent"]))
        env.close()
    (in_worker, episodes, harness), (launched, launched_episodes, verifiers_harness) = results[True], results[False]
    assert harness is WorkerNullHarness and verifiers_harness is NullHarness
    assert in_worker < 0.05 < launched, (in_worker, launched)  # a launched program costs a Python start-up
    for ep in episodes + launched_episodes:
        assert ep.error is None and 0.0 <= ep.reward <= 1.0 and set(ep.metrics) == {"exact"}
        (call,) = ep.calls
        assert call.prompt_ids == prompt_ids(byte_tokenizer(), task.messages()) and call.completion_ids


def test_only_the_null_harness_in_the_subprocess_runtime_runs_in_the_worker():
    from primerl_verifiers.v1 import harness_id

    assert harness_id(config()) == "primerl-null"
    assert harness_id(config(in_process=False)) == "null"
    assert harness_id(config(runtime="docker")) == "null"  # the program runs in the container
    assert harness_id(config(harness="bash")) == "bash"  # its bash tool runs in the runtime


def test_the_in_worker_program_exits_as_its_process_would(tmp_path):
    """primerl-null's program result is the process's: argparse's usage error exits 2 with its
    usage text, a failure inside exits 1 with its traceback, a model transport error exits
    with verifiers' transport status; a file argument is the runtime workdir's."""
    import primerl_null
    from verifiers.v1.errors import MODEL_TRANSPORT_ERROR_EXIT_CODE

    async def run(*argv):
        try:
            return await primerl_null.run_program(list(argv), tmp_path)
        finally:
            await primerl_null.aclose()

    usage = asyncio.run(run())
    assert usage.exit_code == 2 and "the following arguments are required: --base-url" in usage.stderr
    dead = ["--base-url=http://127.0.0.1:9/v1", "--api-key=k", "--model=m", "--initial-messages-file=m.json"]
    missing = asyncio.run(run(*dead))
    assert missing.exit_code == 1 and f"FileNotFoundError: [Errno 2] No such file or directory: '{tmp_path / 'm.json'}'" in missing.stderr
    (tmp_path / "m.json").write_text(json.dumps([{"role": "user", "content": "hi"}]))
    transport = asyncio.run(run(*dead))
    assert transport.exit_code == MODEL_TRANSPORT_ERROR_EXIT_CODE and "APIConnectionError" in transport.stderr
    assert not (tmp_path / "m.json").exists()  # read and removed, as the program does


class ScriptedPolicy:
    """An engine in front of the real one whose first turn is scripted: while no tool result
    is in the prompt it answers ``first`` (with the real engine's logprobs of those tokens),
    after one it forwards the request. Records every exchange, by prompt."""

    def __init__(self, engine: str, first: list[int]) -> None:
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse

        self.engine, self.first, self.exchanges = engine, first, {}
        app = FastAPI()

        @app.get("/v1/models")
        async def models():
            async with httpx.AsyncClient() as http:
                return JSONResponse((await http.get(engine + "/v1/models")).json())

        @app.post("/inference/v1/generate")
        async def generate(request: Request):
            body = await request.json()
            prompt = body["token_ids"]
            async with httpx.AsyncClient(timeout=120) as http:
                if OBSERVATION not in prompt:
                    score = {"token_ids": prompt + first, "sampling_params": {"max_tokens": 0, "prompt_logprobs": 0}}
                    rows = (await http.post(engine + "/inference/v1/generate", json=score)).json()["prompt_logprobs"]
                    lps = [rows[len(prompt) + i][str(t)]["logprob"] for i, t in enumerate(first)]
                    choice = {"index": 0, "finish_reason": "stop", "token_ids": first, "logprobs": {"content": [
                        {"token": f"token_id:{t}", "logprob": lp, "top_logprobs": []} for t, lp in zip(first, lps)]}}
                    out = {"request_id": "scripted", "prompt_token_ids": prompt, "choices": [choice]}
                else:
                    out = (await http.post(engine + "/inference/v1/generate", json=body)).json()
            choice = out["choices"][0]
            self.exchanges.setdefault(tuple(prompt), []).append(
                (choice["token_ids"], [c["logprob"] for c in choice["logprobs"]["content"]]))
            return JSONResponse(out)

        import uvicorn

        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "ScriptedPolicy":
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve()), daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)
        return self

    def __exit__(self, *_exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.mark.slow
def test_a_multi_turn_tool_episode_is_one_token_exact_sample(server):
    """vf-reverse-tool-v1 through the null harness: turn 1 calls the task's MCP tool
    (scripted), the tool's result comes back, turn 2 is the real engine's. The bridge keeps
    the engine's own tokens, so the episode is one sample whose tokens are every exchange's
    prompt and completion, with loss exactly on what was sampled and the engine's logprobs."""
    from primerl_verifiers.env import VerifiersEnv

    tok = byte_tokenizer()
    env = VerifiersEnv(config(id="vf-reverse-tool-v1", args={}, max_turns=3))
    task = next(t for t in env.tasks("train") if t.answer == "olleh")
    first = list(tok.encode('<tool_call>{"name": "reverse_tools_reverse", "arguments": {"text": "hello"}}</tool_call>',
                            add_special_tokens=False)) + [EOS_TOKEN_ID]
    with ScriptedPolicy(server.url, first) as policy:
        episodes = env.run_group(task, endpoint(policy.url, max_tokens=16), 2)
    env.close()
    assert len(episodes) == 2
    for ep in episodes:
        assert ep.error is None and ep.metrics["tool_calls"] == 1.0, ep
        assert len(ep.calls) == 2 and ep.calls[0].completion_ids == first
        for call in ep.calls:  # each call is one exchange with the engine, token for token
            assert (call.completion_ids, call.logprobs) in policy.exchanges[tuple(call.prompt_ids)]
        one, two = ep.calls
        turn = len(one.prompt_ids) + len(one.completion_ids)
        assert two.prompt_ids[:turn] == one.prompt_ids + one.completion_ids
        assert tok.decode(two.prompt_ids[turn:]) == "<|observation|>\nolleh<|assistant|>\n"  # the tool's result
        (sample,) = interleave(ep.calls)  # bridged, not re-rendered: one sample
        assert sample.tokens == two.prompt_ids + two.completion_ids and sample.turns == 2
        assert [t for t, m in zip(sample.tokens, sample.loss_mask) if m] == one.completion_ids + two.completion_ids
        assert sum(sample.loss_mask) == len(first) + len(two.completion_ids)
        assert [lp for lp, m in zip(sample.logprobs, sample.loss_mask) if m] == one.logprobs + two.logprobs
        assert ep.reward == float(tok.decode(two.completion_ids, skip_special_tokens=True).strip() == "olleh")


def test_bad_config_is_one_line():
    from primerl_verifiers.env import VerifiersEnv

    with pytest.raises(ConfigError, match="env.id.*--env.id"):
        load_config(ConfigSources(overrides=[("env.name", "verifiers")]))
    with pytest.raises(ConfigError, match="env.max_turns"):
        load_config(ConfigSources(overrides=[("env.name", "verifiers"), ("env.id", "vf-reverse-v1"),
                                             ("env.max_turns", "0")]))
    cases = [({"id": "vf-no-such-env"}, "env.id: verifiers finds no taskset 'vf-no-such-env' installed; pip install"),
             ({"harness": "nope"}, "env.harness: verifiers finds no harness 'nope' installed; name one of .*null"),
             ({"runtime": "nope"}, "env.runtime: .*'subprocess'.*; fix --env.runtime"),
             ({"args": {"num_tasks": "x"}}, "env.args.num_tasks: .*integer.*; fix --env.args.num_tasks")]
    for kw, message in cases:
        with pytest.raises(ValueError, match=message) as info:
            list(VerifiersEnv(config(**kw)).tasks("train"))
        assert "\n" not in str(info.value)


def test_uv_comes_from_the_venv_that_runs_or_is_asked_for(tmp_path, monkeypatch):
    """A venv used without being activated still gives the subprocess runtime its uv (else
    verifiers would try to download uv); with no uv anywhere the run stops in one line."""
    import sysconfig

    from primerl_verifiers.v1 import _ensure_uv

    scripts = sysconfig.get_path("scripts")
    monkeypatch.setenv("PATH", str(tmp_path))
    _ensure_uv()
    assert os.environ["PATH"].split(os.pathsep)[0] == scripts
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(sysconfig, "get_path", lambda name: str(tmp_path))
    with pytest.raises(ValueError, match=r"env.runtime: .*uv, which is not installed; .* -m pip install uv$"):
        _ensure_uv()
    _ensure_uv(required=False)  # primerl-null: no process to launch, no uv needed


@pytest.mark.slow
def test_a_v1_env_trains_end_to_end(tmp_path):
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "primerl.cli", "run", "--model", "glm5", "--env", "verifiers",
                        "--env.id", "vf-reverse-v1", "--max-steps", "3", "--orchestrator.batch_size", "8",
                        "--orchestrator.group_size", "4", "--orchestrator.max_tokens", "16", "--output-dir", str(out)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3] and all(row["errors/rollout"] == 0 for row in rows)
