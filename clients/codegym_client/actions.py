"""Turning model output into actions.

Models trained on CodeGym answer with `<|FunctionCallBegin|>[{"name": ..., "parameters": {...}}]
<|FunctionCallEnd|>`; OpenAI-style models answer with `tool_calls`. Both become the CodeGym JSON
action string the runtime takes. Parsing failures raise `ActionParseError` with a message that can
be shown to the agent as its observation.

The action rule, the same here and in the runtime (which applies it to every action it is sent,
the dicts and JSON strings a trainer passes to a client included), so that an action means the same
thing whichever side reads it:

- An action is a JSON object with `"name"` (a string) and its parameters under exactly one of two
  keys: `"parameters"` (CodeGym's word), an object, or `"arguments"` (OpenAI's word), an object or
  the JSON text of one, as OpenAI's `tool_calls` carry it. Naming both keys is an error, never a
  silent choice between them: the runtime used to drop `arguments` and run the tool with `{}`.
- Neither key, `null`, or `arguments` holding empty or blank text means no parameters: `{}`.
  Anything else that is not an object (a list, a number, a string under `parameters`) is an error.
- Other keys of the object (an OpenAI call's `id` or `type`) are ignored.
- JSON is read as Python's `json.loads` reads it (`Infinity`, `-Infinity` and `NaN` included), as
  the environment itself reads it.
- The environment always receives the canonical `{"name": ..., "parameters": {...}}`.

Framing is separate from the rule: a `<|FunctionCallBegin|>` block holds one object or a list of
them, and one step takes exactly one call.
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


def _parameters(name: str, item: dict[str, Any]) -> dict[str, Any]:
    """The parameters of an action object under the module's rule."""
    if "parameters" in item and "arguments" in item:
        raise ActionParseError(
            f'{name} names its parameters twice: use "parameters" or "arguments", not both'
        )
    key = "arguments" if "arguments" in item else "parameters"
    value = item.get(key)
    if key == "arguments" and isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else None
        except RecursionError:
            raise ActionParseError(f"arguments of {name} are nested too deeply") from None
        except ValueError as exc:
            raise ActionParseError(f"arguments of {name} are not valid JSON: {exc}") from None
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ActionParseError(f"{key} of {name} must be an object, got {type(value).__name__}")
    return value


def action_from_object(item: Any) -> Action:
    """The action an object stands for (a dict parsed from JSON, or one a trainer built), checked
    against the module's rule."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        raise ActionParseError('each function call must be an object {"name": ..., "parameters": {...}}')
    return Action(item["name"], _parameters(item["name"], item))


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
    return [action_from_object(item) for item in items]


def parse_function_call(text: str) -> Action:
    """The single call of a CodeGym turn (the protocol allows one function per step)."""
    actions = parse_function_calls(text)
    if len(actions) != 1:
        raise ActionParseError(f"call one function per step, got {len(actions)}")
    return actions[0]


def from_tool_calls(tool_calls: Any) -> list[Action]:
    """Actions from OpenAI `tool_calls` (SDK objects or plain dicts): each call's `function` is read
    as an action object with `arguments`, so its JSON text or an object both work."""
    actions: list[Action] = []
    for call in tool_calls or []:
        function = call.get("function") if isinstance(call, dict) else getattr(call, "function", None)
        if function is None:
            raise ActionParseError("tool call has no function")
        if isinstance(function, dict):
            name, arguments = function.get("name"), function.get("arguments")
        else:
            name, arguments = getattr(function, "name", None), getattr(function, "arguments", None)
        actions.append(action_from_object({"name": name, "arguments": arguments}))
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
