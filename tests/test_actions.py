"""Parsing model output into actions: CodeGym's function-call markers and OpenAI tool_calls."""

from __future__ import annotations

import json

import pytest
from openai.types.chat import ChatCompletionMessage

from clients.actions import ActionParseError, from_tool_calls, parse_function_call, parse_function_calls


def test_last_complete_block_wins_and_think_is_skipped() -> None:
    text = (
        '<think>maybe <|FunctionCallBegin|>[{"name": "Wrong", "parameters": {}}]<|FunctionCallEnd|></think>'
        'First I look. <|FunctionCallBegin|>[{"name": "Observe", "parameters": {}}]<|FunctionCallEnd|>'
        ' no, rather <|FunctionCallBegin|>[{"name":"GetCell", "parameters":{"row": 1, "col": 2}}]<|FunctionCallEnd|>'
    )
    action = parse_function_call(text)
    assert (action.name, action.parameters) == ("GetCell", {"row": 1, "col": 2})
    assert json.loads(action.to_json()) == {"name": "GetCell", "parameters": {"row": 1, "col": 2}}


def test_a_bare_object_and_missing_parameters_are_accepted() -> None:
    (action,) = parse_function_calls('<|FunctionCallBegin|>{"name": "Observe"}<|FunctionCallEnd|>')
    assert action.parameters == {}


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("I will call Observe.", "no function call"),
        ('[{"name": "Observe"}]<|FunctionCallEnd|>', "without a matching"),
        ("<|FunctionCallBegin|>[{name: Observe}]<|FunctionCallEnd|>", "not valid JSON"),
        ("<|FunctionCallBegin|>[]<|FunctionCallEnd|>", "empty"),
        ('<|FunctionCallBegin|>[{"parameters": {}}]<|FunctionCallEnd|>', '"name"'),
        ('<|FunctionCallBegin|>[{"name": "A", "parameters": [1]}]<|FunctionCallEnd|>', "must be an object"),
        ('<|FunctionCallBegin|>[{"name": "A"}, {"name": "B"}]<|FunctionCallEnd|>', "one function per step"),
        ('<|FunctionCallBegin|>[{"name": "A"}]', "no function call"),
    ],
)
def test_bad_turns_raise_a_clear_error(text: str, words: str) -> None:
    with pytest.raises(ActionParseError, match=words):
        parse_function_call(text)


def test_openai_tool_calls_from_sdk_objects_and_dicts() -> None:
    message = ChatCompletionMessage.model_validate(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "GetCell", "arguments": '{"row": 0, "col": 1}'},
                },
                {"id": "c2", "type": "function", "function": {"name": "Observe", "arguments": ""}},
            ],
        }
    )
    actions = from_tool_calls(message.tool_calls)
    assert [(a.name, a.parameters) for a in actions] == [("GetCell", {"row": 0, "col": 1}), ("Observe", {})]
    dicts = [{"function": {"name": "Done", "arguments": '{"answer": 2}'}}]
    assert from_tool_calls(dicts)[0].parameters == {"answer": 2}
    with pytest.raises(ActionParseError, match="not valid JSON"):
        from_tool_calls([{"function": {"name": "Done", "arguments": "{answer"}}])
    with pytest.raises(ActionParseError, match="no tool calls"):
        from_tool_calls(None)
