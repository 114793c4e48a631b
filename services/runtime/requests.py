"""What the runtime reads from a request before anything runs: the task's config and the action.

Checks here are the environment's own rules, no stricter: CodeGym's environments parse actions
and configs with Python's `json.loads`, which accepts `Infinity`, `-Infinity` and `NaN` (CodeGym's
own `solve()` sends `float('inf')` through `json.dumps`), so the runtime accepts them too. It
refuses only what the environment could not get at all: nesting past `MAX_JSON_DEPTH` (which
would crash the environment's parser) and text protobuf cannot carry (a lone surrogate).

The action rule (the same in the client, `codegym_client/actions.py`): an action is one JSON object
`{"name": str, "parameters": {...}}` or `{"name": str, "arguments": {...}}` (OpenAI's word, where
`arguments` may also be the JSON text of the object, as OpenAI's tool calls carry it), or a list of
exactly one such object; naming both `parameters` and `arguments` is refused. The environment
always receives `{"name": ..., "parameters": {...}}`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from codegym.errors import Reason, Refusal
from codegym_client.actions import ActionParseError, action_from_object
from codegym_client.api.runtime.v1 import runtime_service_pb2 as rt
from services.runtime.config import RuntimeConfig

# Actions and configs deeper than this are refused (CodeGym's are a few levels deep); environment
# code, which may recurse over what it is given, never sees them.
MAX_JSON_DEPTH = 100
LONE_SURROGATE = "a lone surrogate escape (like \\ud800) is not Unicode text"


def shown(text: str, limit: int = 80) -> str:
    """`text` quoted for a message: ASCII-escaped and cut (ids and names can be megabytes of anything)."""
    if len(text) <= limit:
        return ascii(text)
    return f"{text[:limit]!a}... ({len(text)} characters)"


def json_problem(value: Any, max_depth: int = MAX_JSON_DEPTH) -> str | None:
    """Why a parsed JSON value is refused (nested too deeply), or None (iterative, no recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list | tuple | set | frozenset):
            if depth > max_depth:
                return f"nested deeper than {max_depth} levels"
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return None


def is_unicode(text: str) -> bool:
    """False for text holding a lone surrogate (JSON's `"\\ud800"`), which no protobuf string can carry."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def parse_json(text: str) -> tuple[Any, str | None]:
    """JSON as Python's `json.loads` reads it, at most MAX_JSON_DEPTH deep: the value, or why not."""
    try:
        value = json.loads(text)
    except RecursionError:
        return None, f"nested deeper than {MAX_JSON_DEPTH} levels"
    except ValueError as exc:  # JSONDecodeError, an integer of more than 4300 digits
        return None, str(exc).split("; use sys.", 1)[0]
    return value, json_problem(value)


def dumps(value: Any) -> str:
    """JSON text as the environment's `json.loads` reads it back (non-finite numbers included)."""
    return json.dumps(value, ensure_ascii=False, allow_nan=True)


def config_json(config: dict[str, Any]) -> tuple[str, str | None]:
    """The config as the JSON the jail gets, or why JSON cannot carry it."""
    problem = json_problem(config)
    if problem is None:
        try:
            text = dumps(config)
        except (TypeError, ValueError, RecursionError) as exc:  # a Python literal's set, bytes...
            problem = str(exc)
        else:
            if is_unicode(text):
                return text, None
            problem = LONE_SURROGATE
    return "", problem


def _invalid(message: str) -> tuple[str, rt.StepError]:
    return "", rt.StepError(code=rt.STEP_ERROR_CODE_INVALID_ACTION, message=message)


def action_text(
    request: rt.StepRequest, tool_names: Sequence[str], max_bytes: int
) -> tuple[str, rt.StepError | None]:
    """The action as the canonical CodeGym JSON string, or the typed reason it is refused."""
    which = request.WhichOneof("action")
    if which == "action_json":
        text = request.action_json
        if len(text.encode()) > max_bytes:
            return _invalid(f"action is {len(text.encode())} bytes (max {max_bytes})")
        action, problem = parse_json(text)
        if problem is not None:
            return _invalid(f"action is not valid JSON: {problem}")
        if isinstance(action, list):
            if len(action) != 1:
                return _invalid(f"one function call per step, got a list of {len(action)}")
            action = action[0]
        try:
            # The rule trainers' clients apply, applied here too: one rule on both sides.
            parsed = action_from_object(action)
        except ActionParseError as exc:
            return _invalid(str(exc))
        name, parameters = parsed.name, parsed.parameters
        problem = json_problem(parameters, MAX_JSON_DEPTH - 1)
        if problem is not None:  # `arguments` given as JSON text is parsed only now
            return _invalid(f"arguments are {problem}")
    elif which == "tool_call":
        name = request.tool_call.name
        text = request.tool_call.parameters_json or "{}"
        size = len(name.encode()) + len(text.encode())
        if size > max_bytes:
            return _invalid(f"tool call is {size} bytes (max {max_bytes})")
        parameters, problem = parse_json(text)
        if problem is not None:
            return _invalid(f"parameters_json is not valid JSON: {problem}")
    else:
        return _invalid("the step has no action (action_json or tool_call)")
    if parameters is None:
        parameters = {}
    if not isinstance(parameters, dict):
        return _invalid(f"parameters must be a JSON object, got {type(parameters).__name__}")
    if name not in tool_names:
        return "", rt.StepError(
            code=rt.STEP_ERROR_CODE_UNKNOWN_TOOL,
            message=f"unknown tool {shown(name)}; the tools are {', '.join(tool_names)}",
        )
    canonical = dumps({"name": name, "parameters": parameters})
    if not is_unicode(canonical):
        return _invalid(f"action is not valid: {LONE_SURROGATE}")
    return canonical, None


def create_limits(request: rt.CreateSessionRequest, config: RuntimeConfig) -> tuple[int, int]:
    """A create's step cap and step timeout (its own or the defaults), refused past the runtime's
    bounds; and its run id's length, which keys the episode record."""
    options = request.options
    max_steps = options.max_steps or config.default_max_steps
    if max_steps > config.max_max_steps:
        raise Refusal(Reason.INVALID_REQUEST, f"max_steps {max_steps} exceeds {config.max_max_steps}")
    if len(request.run_id) > config.max_run_id:
        raise Refusal(
            Reason.INVALID_REQUEST,
            f"run_id is {len(request.run_id)} characters long (max {config.max_run_id})",
        )
    timeout_ms = options.step_timeout_ms or config.step_timeout_ms
    if timeout_ms > config.max_step_timeout_ms:
        raise Refusal(
            Reason.INVALID_REQUEST, f"step_timeout_ms {timeout_ms} exceeds {config.max_step_timeout_ms}"
        )
    return max_steps, timeout_ms
