"""Parsing model output into actions: CodeGym's function-call markers and OpenAI tool_calls, and
the action rule (`parameters` or `arguments`, never both) the client shares with the runtime."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from openai.types.chat import ChatCompletionMessage

from codegym_client.actions import (
    BEGIN,
    END,
    ActionParseError,
    action_from_object,
    from_tool_calls,
    parse_function_call,
    parse_function_calls,
    tool_call_action,
)


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


# The action rule as a table: the JSON text of an action object, and the parameters the tool runs
# with (None: the action is refused). The runtime is held to the same table below.
RULE: list[tuple[str, dict[str, Any] | None]] = [
    ('{"name": "GetCell", "parameters": {"row": 1}}', {"row": 1}),
    ('{"name": "GetCell", "arguments": {"row": 1}}', {"row": 1}),
    ('{"name": "GetCell", "arguments": "{\\"row\\": 1}"}', {"row": 1}),
    ('{"name": "GetCell", "arguments": "null"}', {}),
    ('{"name": "GetCell", "arguments": ""}', {}),
    ('{"name": "GetCell", "arguments": "  "}', {}),
    ('{"name": "GetCell", "arguments": null}', {}),
    ('{"name": "GetCell", "parameters": null}', {}),
    ('{"name": "GetCell"}', {}),
    ('{"name": "GetCell", "id": "c1", "type": "function", "arguments": "{}"}', {}),
    (
        '{"name": "GetCell", "parameters": {"best": -Infinity, "cap": Infinity}}',
        {"best": -math.inf, "cap": math.inf},
    ),
    ('{"name": "GetCell", "arguments": "{\\"cap\\": Infinity}"}', {"cap": math.inf}),
    ('{"name": "GetCell", "parameters": {}, "arguments": {}}', None),
    ('{"name": "GetCell", "parameters": {"row": 1}, "arguments": "{\\"row\\": 2}"}', None),
    ('{"name": "GetCell", "parameters": null, "arguments": null}', None),
    ('{"name": "GetCell", "parameters": "{\\"row\\": 1}"}', None),
    ('{"name": "GetCell", "parameters": [1]}', None),
    ('{"name": "GetCell", "arguments": "{row"}', None),
    ('{"name": "GetCell", "arguments": "[1]"}', None),
    ('{"name": "GetCell", "arguments": [1]}', None),
    ('{"name": "GetCell", "arguments": 3}', None),
    ('{"parameters": {}}', None),
    ('{"name": 5, "parameters": {}}', None),
]


@pytest.mark.parametrize(("text", "expected"), RULE, ids=[t for t, _ in RULE])
def test_the_action_rule_holds_for_objects_and_model_turns(
    text: str, expected: dict[str, Any] | None
) -> None:
    turn = f"I look at the cell. {BEGIN}[{text}]{END}"
    if expected is None:
        with pytest.raises(ActionParseError):
            action_from_object(json.loads(text))
        with pytest.raises(ActionParseError):
            parse_function_call(turn)
        return
    for action in (action_from_object(json.loads(text)), parse_function_call(turn)):
        assert action.name == "GetCell" and action.parameters == expected
        # what is sent on is always CodeGym's canonical form, which the environment's json.loads reads
        assert json.loads(action.to_json()) == {"name": "GetCell", "parameters": expected}


def test_both_keys_is_an_error_that_says_so() -> None:
    with pytest.raises(ActionParseError, match='"parameters" or "arguments", not both'):
        action_from_object({"name": "Done", "parameters": {"answer": 1}, "arguments": {"answer": 2}})


def test_tool_calls_carry_arguments_as_text_or_as_an_object() -> None:
    calls = [
        {"id": "a", "type": "function", "function": {"name": "GetCell", "arguments": {"row": 3}}},
        {"id": "b", "type": "function", "function": {"name": "Observe", "arguments": None}},
        {"id": "c", "type": "function", "function": {"name": "Observe"}},
    ]
    assert [(a.name, a.parameters) for a in from_tool_calls(calls)] == [
        ("GetCell", {"row": 3}),
        ("Observe", {}),
        ("Observe", {}),
    ]
    with pytest.raises(ActionParseError, match="arguments of Done must be an object, got list"):
        from_tool_calls([{"function": {"name": "Done", "arguments": "[1, 2]"}}])
    message = {
        "role": "assistant",
        "tool_calls": [{"function": {"name": "Done", "arguments": '{"answer": Infinity}'}}],
    }
    action = tool_call_action(message)
    assert action is not None and action.parameters == {"answer": math.inf}


def _runtime_parameters(text: str) -> dict[str, Any] | None:
    """The parameters the runtime runs the tool with for `text`, or None when it refuses it."""
    # Imported here, not skipped when missing: the server side must exist in this checkout.
    from codegym_client.api.runtime.v1 import runtime_service_pb2 as rt
    from services.runtime import requests

    canonical, error = requests.action_text(rt.StepRequest(action_json=text), ["GetCell"], 64 * 1024)
    if error is not None:
        return None
    action = json.loads(canonical)
    assert set(action) == {"name", "parameters"} and action["name"] == "GetCell"
    parameters: dict[str, Any] = action["parameters"]
    return parameters


@pytest.mark.parametrize(("text", "expected"), RULE, ids=[t for t, _ in RULE])
def test_the_runtime_reads_every_action_as_the_client_does(
    text: str, expected: dict[str, Any] | None
) -> None:
    # A trainer's dict or JSON string goes to the runtime as is: the runtime must apply the same rule,
    # or an action would mean one thing in the client and another in the environment.
    assert _runtime_parameters(text) == expected
    assert _runtime_parameters(f"[{text}]") == expected
