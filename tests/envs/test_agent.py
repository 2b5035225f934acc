"""Agent envs' model calls -> token-exact training samples; tool calls in server replies."""

import base64

import numpy as np
import pytest

from primerl.envs.agent import ModelCall, interleave
from primerl.envs.multiturn import split_tool_calls


def call(prompt, completion, version=0, routed=None):
    return ModelCall(prompt_ids=prompt, completion_ids=completion, logprobs=[-0.5] * len(completion),
                     versions=[version] * len(completion), routed_experts=routed)


def routed_payload(rows):
    """The inference API's routed-experts payload of ``rows`` ([tokens, layers, top_k])."""
    array = np.asarray(rows, dtype=np.uint8)
    return {"data": base64.b64encode(array.tobytes()).decode(), "dtype": "uint8", "shape": list(array.shape),
            "start": 0}


def test_calls_that_extend_each_other_merge_into_one_sample():
    first = routed_payload([[[0, 1]]] * 3)
    last = routed_payload([[[i, 2]] for i in range(6)])  # covers prompt + completion but the last token
    calls = [call([1, 2], [3, 4], 0, first), call([1, 2, 3, 4, 9, 9], [5], 1, last)]
    (s,) = interleave(calls)
    assert s.tokens == [1, 2, 3, 4, 9, 9, 5]
    assert s.loss_mask == [0, 0, 1, 1, 0, 0, 1]
    assert s.logprobs == [0.0, 0.0, -0.5, -0.5, 0.0, 0.0, -0.5]
    assert s.versions == [-1, -1, 0, 0, -1, -1, 1]
    assert s.routed_experts.tolist() == [[[i, 2]] for i in range(6)] and s.turns == 2


def test_a_rewritten_history_starts_a_new_sample():
    calls = [call([1, 2], [3]), call([1, 7, 3, 8], [4]), call([1, 7, 3, 8, 4, 6], [5]), call([1], [])]
    a, b = interleave(calls)
    assert a.tokens == [1, 2, 3] and a.turns == 1
    assert b.tokens == [1, 7, 3, 8, 4, 6, 5] and b.loss_mask == [0, 0, 0, 0, 1, 0, 1] and b.turns == 2


def test_a_sample_whose_lists_disagree_fails_where_it_is_made():
    from primerl.samples import Sample

    with pytest.raises(ValueError, match="versions has 2 entries for 3 tokens"):
        Sample(tokens=[1, 2, 3], loss_mask=[0, 1, 1], versions=[0, 0], task_id="t")


def test_a_call_needs_one_logprob_and_version_per_token():
    with pytest.raises(ValueError, match="one logprob and one version per completion token"):
        ModelCall(prompt_ids=[1], completion_ids=[2, 3], logprobs=[0.0], versions=[0, 0])


def test_split_tool_calls():
    text = 'Let me add.<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    assert split_tool_calls(text) == ("Let me add.", [{"name": "add", "arguments": {"a": 1}}])
    assert split_tool_calls("no calls") == ("no calls", [])
    broken = "<tool_call>{not json}</tool_call>"
    assert split_tool_calls(broken) == (broken, [])
