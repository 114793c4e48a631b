"""Turning model output into actions.

Models trained on CodeGym answer with `<|FunctionCallBegin|>[{"name": ..., "parameters": {...}}]
<|FunctionCallEnd|>`; OpenAI-style models answer with `tool_calls`. Both become the CodeGym JSON
action string the runtime takes. Parsing failures raise `ActionParseError` with a message that can
be shown to the agent as its observation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

BEGIN = "<|FunctionCallBegin|>"
END = "<|FunctionCallEnd|>"


class ActionParseError(ValueError):
    """The model output holds no usable function call."""


@dataclass(frozen=True)
class Action:
    name: str
    parameters: dict[str, Any]

    def to_json(self) -> str:
        return json.dumps({"name": self.name, "parameters": self.parameters}, ensure_ascii=False)


def _action(item: Any) -> Action:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        raise ActionParseError('each function call must be an object {"name": ..., "parameters": {...}}')
    parameters = item.get("parameters", item.get("arguments", {}))
    if isinstance(parameters, str):
        try:
            parameters = json.loads(parameters or "{}")
        except ValueError as exc:
            raise ActionParseError(f"parameters of {item['name']} are not valid JSON: {exc}") from None
    if parameters is None:
        parameters = {}
    if not isinstance(parameters, dict):
        raise ActionParseError(f"parameters of {item['name']} must be an object")
    return Action(item["name"], parameters)


def parse_function_calls(text: str) -> list[Action]:
    """Every call in the last complete `<|FunctionCallBegin|>[...]<|FunctionCallEnd|>` block.

    The last block is the model's decision: earlier ones usually sit in its reasoning. A `</think>`
    section is skipped for the same reason.
    """
    _, think_end, answer = text.rpartition("</think>")
    if think_end:
        text = answer
    end = text.rfind(END)
    if end < 0:
        raise ActionParseError(f"no function call: expected {BEGIN}[...]{END}")
    begin = text.rfind(BEGIN, 0, end)
    if begin < 0:
        raise ActionParseError(f"{END} without a matching {BEGIN}")
    body = text[begin + len(BEGIN) : end].strip()
    try:
        value = json.loads(body)
    except ValueError as exc:
        raise ActionParseError(f"function call is not valid JSON: {exc}") from None
    items = value if isinstance(value, list) else [value]
    if not items:
        raise ActionParseError("function call list is empty")
    return [_action(item) for item in items]


def parse_function_call(text: str) -> Action:
    """The single call of a CodeGym turn (the protocol allows one function per step)."""
    actions = parse_function_calls(text)
    if len(actions) != 1:
        raise ActionParseError(f"call one function per step, got {len(actions)}")
    return actions[0]


def from_tool_calls(tool_calls: Any) -> list[Action]:
    """Actions from OpenAI `tool_calls` (SDK objects or plain dicts), arguments parsed from JSON."""
    actions: list[Action] = []
    for call in tool_calls or []:
        function = call.get("function") if isinstance(call, dict) else getattr(call, "function", None)
        if function is None:
            raise ActionParseError("tool call has no function")
        if isinstance(function, dict):
            name, arguments = function.get("name"), function.get("arguments", "{}")
        else:
            name, arguments = getattr(function, "name", None), getattr(function, "arguments", "{}")
        actions.append(_action({"name": name, "parameters": arguments}))
    if not actions:
        raise ActionParseError("no tool calls")
    return actions


def tool_call_action(message: Any) -> Action | None:
    """The action of an OpenAI assistant message with native `tool_calls` (a dict, an SDK message,
    or the `tool_calls` list itself); None when `message` is not one. One call per step."""
    if isinstance(message, list):
        calls: Any = message
    elif isinstance(message, dict):
        if "tool_calls" not in message:
            return None
        calls = message["tool_calls"]
    elif hasattr(message, "tool_calls"):
        calls = message.tool_calls
    else:
        return None
    actions = from_tool_calls(calls)
    if len(actions) != 1:
        raise ActionParseError(f"call one tool per step, got {len(actions)}")
    return actions[0]
