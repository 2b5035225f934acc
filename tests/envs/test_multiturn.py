"""The multi-turn env API: tools, token-exact turns, worker processes, wordle, alphabet-sort."""

import asyncio

import pytest

from primerl.envs import Task
from primerl.envs.multiturn import ToolEnv, parse_tool_calls, prompt_ids, tool_schema, turn_suffix
from primerl.envs.workers import EnvCallError, EnvWorkers
from primerl.tokenizer import byte_tokenizer


def test_tool_calls_are_parsed_and_errors_explained():
    text = 'x <tool_call>{"name": "read", "arguments": {"path": "a.py"}}</tool_call> y ' \
           '<tool_call>{"name": "run", "arguments": "{\\"cmd\\": \\"ls\\"}"}</tool_call>'
    assert parse_tool_calls(text) == [{"name": "read", "arguments": {"path": "a.py"}},
                                      {"name": "run", "arguments": {"cmd": "ls"}}]
    assert parse_tool_calls("no tools here") == []
    assert parse_tool_calls("<tool_call>{nope}</tool_call>").startswith("error: tool call is not valid JSON")
    assert parse_tool_calls('<tool_call>{"arguments": {}}</tool_call>').startswith("error: a tool call must be")


class Calc(ToolEnv):
    tools = ("add", "submit")

    def add(self, state, a: int, b: int = 0) -> str:
        """Add two integers."""
        return str(a + b)

    def submit(self, state, answer: str) -> str:
        """Give the final answer."""
        state["answer"] = answer
        return "ok"

    def reward(self, task, state):
        return float(state.get("answer") == task.answer)


def test_tool_env_schemas_calls_and_stop():
    assert tool_schema(Calc.add)["function"] == {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a"]}}
    env, task, state = Calc(), Task("t", "2+3?", answer="5"), {}
    assert "add(a: integer, b: integer?): Add two integers." in env.system()
    turn = env.step(task, state, '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>')
    assert turn.messages == [{"role": "tool", "content": "5"}] and not turn.done
    turn = env.step(task, state, '<tool_call>{"name": "add", "arguments": {"x": 1}}</tool_call>')
    assert turn.messages[0]["content"].startswith("error: bad arguments for add")
    turn = env.step(task, state, '<tool_call>{"name": "rm", "arguments": {}}</tool_call>')
    assert "unknown tool 'rm'" in turn.messages[0]["content"]
    turn = env.step(task, state, '<tool_call>{"name": "submit", "arguments": {"answer": "5"}}</tool_call>')
    assert turn.done and env.score(task, state) == 1.0
    assert env.step(task, {}, "just text").done  # no tool call ends the episode


def test_turns_are_appended_token_exactly():
    tok = byte_tokenizer()
    history = [{"role": "system", "content": "S"}, {"role": "user", "content": "guess"}]
    ids = prompt_ids(tok, history)
    model_out = tok.encode("crane", add_special_tokens=False) + [tok.eos_token_id]  # what the model produced
    history.append({"role": "assistant", "content": "crane"})
    new = [{"role": "user", "content": "crane --G-Y"}]
    ids = ids + model_out + turn_suffix(tok, history, new)
    # the model's own tokens (eos included) stay; the env turn follows; a generation prompt ends it
    assert ids[-len(tok.encode("<|assistant|>\n", add_special_tokens=False)):] == \
        tok.encode("<|assistant|>\n", add_special_tokens=False)
    assert tok.decode(ids).count("crane --G-Y") == 1
    assert model_out == ids[len(prompt_ids(tok, history[:2])):][: len(model_out)]


def test_worker_processes_survive_hangs_crashes_and_errors():
    from primerl.envs.multiturn import MultiTurnConfig

    async def go():
        from crashy_env import Crashy

        workers = EnvWorkers(Crashy, MultiTurnConfig(), processes=2)
        task = Task("t", "go")
        try:
            pids = {await workers.call("pid") for _ in range(4)}
            turn = await workers.call("step", task, {}, "hi", timeout=30)
            assert turn.state == {"n": 1} and turn.messages[0]["content"] == "ok 1"
            with pytest.raises(EnvCallError, match="longer than"):
                await workers.call("step", task, {}, "hang", timeout=2)
            with pytest.raises(EnvCallError, match="died"):
                await workers.call("step", task, {}, "die", timeout=30)
            with pytest.raises(EnvCallError, match="env bug"):
                await workers.call("step", task, {}, "raise", timeout=30)
            # the pool is whole again: hung and dead workers were replaced
            results = await asyncio.gather(*(workers.call("step", task, {}, "x", timeout=30) for _ in range(4)))
            assert all(r.messages for r in results) and workers.replaced == 2
            assert {await workers.call("pid") for _ in range(4)} != pids
        finally:
            workers.close()

    asyncio.run(go())


def test_workers_take_a_plugin_qualified_env_and_pass_task_errors_through():
    """``--env wordle:wordle`` (PLUGIN:NAME, the registry's pick) reaches the workers as a
    registry pick, not a module path; an env's TaskError arrives as itself, cause intact."""
    from primerl.config import ConfigSources, load_config
    from primerl.envs import TaskError
    from primerl.envs.multiturn import MultiTurnConfig

    cfg = load_config(ConfigSources(overrides=[]), {"env.name": "wordle:wordle"})
    task = Task("t", "first guess?", answer="apple")

    async def go():
        from crashy_env import Crashy

        wordle, crashy = EnvWorkers(cfg.env.name, cfg.env, processes=1), EnvWorkers(Crashy, MultiTurnConfig(), 1)
        try:
            state = await wordle.call("setup", task, timeout=60)
            turn = await wordle.call("step", task, state, "crane", timeout=60)
            assert turn.messages[0]["content"].startswith("crane --Y-G")
            with pytest.raises(TaskError, match="no python here") as info:
                await crashy.call("step", task, {}, "harness", timeout=30)
            assert info.value.task_id == "t" and crashy.replaced == 0
        finally:
            wordle.close()
            crashy.close()

    asyncio.run(go())


def test_wordle_feedback_and_reward():
    from primerl_wordle.env import Wordle, feedback

    assert feedback("crane", "crane") == "GGGGG"
    # a repeated guess letter is marked only as often as the secret still has it
    assert feedback("allee", "apple") == "GY--G"
    assert feedback("speed", "abide") == "--Y-Y"
    env = Wordle()
    task = Task("t", "first guess?", answer="apple")
    state = env.setup(task)
    turn = env.step(task, state, "I guess crane")
    assert turn.messages[0]["content"].startswith("crane --Y-G") and not turn.done
    turn = env.step(task, turn.state, "apple")
    assert turn.done and env.score(task, turn.state) == pytest.approx(5 / 6)
    state = env.setup(task)
    for _ in range(6):
        turn = env.step(task, state, "mount")
    assert turn.done and env.score(task, state) == 0.0


def test_alphabet_sort_turns_and_reward():
    from primerl_alphabet_sort.env import AlphabetSort

    env = AlphabetSort()
    task = next(iter(env.tasks("train")))
    b = task.info["batches"]
    state = env.setup(task)
    turn = env.step(task, state, ", ".join(sorted(b[0])))
    assert not turn.done and "Add:" in turn.messages[0]["content"]
    turn = env.step(task, state, ", ".join(sorted(b[0] + b[1])))
    turn = env.step(task, state, "wrong")
    assert turn.done and env.score(task, state) == pytest.approx(2 / 3)
