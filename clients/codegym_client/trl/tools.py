"""Tool methods from JSON schemas: each tool of an environment as a method `Name(self, *, param:
type, ...) -> str` that steps the instance's session. TRL lists an environment's public methods
and renders each with `transformers.utils.get_json_schema`, so a method's signature and Google
docstring are written to render back as the tool's own schema (for the types CodeGym's schemas
use)."""

from __future__ import annotations

import inspect
import keyword
from collections.abc import Callable, Mapping
from typing import Any, Protocol


class ToolCaller(Protocol):
    """What a tool method steps: the session of its environment's episode."""

    def call_tool(self, name: str, arguments: dict[str, Any]) -> str: ...


class ToolHost(Protocol):
    """What a tool method is a method of: an environment holding its episode's session. Private,
    since TRL takes every public member of an environment as a tool."""

    _session: ToolCaller


RESERVED = frozenset({"reset", "get_reward"})  # the names TRL does not take as tools
ToolSchema = dict[str, Any]  # an OpenAI tool definition: {"type": "function", "function": {...}}

_SCALARS: dict[str, Any] = {
    "integer": int,
    "number": float,
    "string": str,
    "boolean": bool,
    "null": type(None),
    "array": list,
    "object": dict,
}


def _hint(schema: Mapping[str, Any]) -> Any:
    """The type hint `transformers.utils.get_json_schema` turns back into `schema` (less its
    description): `int`, `list[int]`, `int | str`, `Any` for an empty schema..."""
    kind = schema.get("type")
    if kind is None:
        return Any
    if isinstance(kind, list):
        hints = [_hint({"type": k}) for k in kind]
        union = hints[0]
        for h in hints[1:]:
            union = union | h
        return union
    if kind == "array" and isinstance(schema.get("items"), Mapping) and schema["items"]:
        return list[_hint(schema["items"])]  # type: ignore[misc]
    if kind == "object" and isinstance(schema.get("additionalProperties"), Mapping):
        return dict[str, _hint(schema["additionalProperties"])]  # type: ignore[misc]
    return _SCALARS.get(str(kind), Any)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _docstring(description: str, properties: Mapping[str, Any]) -> str:
    """A Google docstring whose `get_json_schema` parse is `description` and the properties'
    descriptions (one line each: transformers joins an argument's lines with spaces anyway)."""
    lines = [description.strip()]
    if properties:
        lines += ["", "Args:"]
        lines += [f"    {name}: {_one_line(str(p.get('description', '')))}" for name, p in properties.items()]
    return "\n".join(lines)


class _Omitted:
    """Default of an optional tool parameter: left out of the action, so the env's own default applies."""

    def __repr__(self) -> str:
        return "<omitted>"


OMITTED: Any = _Omitted()


def tool_method(schema: ToolSchema) -> Callable[..., str]:
    """One tool as a method `Name(self, *, param: type, ...) -> str` that steps the session."""
    function = schema.get("function", schema)
    name = str(function["name"])
    parameters = function.get("parameters") or {}
    properties: dict[str, Any] = dict(parameters.get("properties") or {})
    required = set(parameters.get("required") or [])
    if not name.isidentifier() or keyword.iskeyword(name) or name.startswith("_") or name in RESERVED:
        raise ValueError(f"tool {name!r} cannot be a method of a TRL environment")
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    annotations: dict[str, Any] = {}
    for arg, arg_schema in properties.items():
        if not arg.isidentifier() or keyword.iskeyword(arg) or arg == "self":
            raise ValueError(f"parameter {arg!r} of tool {name!r} cannot be a Python parameter")
        hint = _hint(arg_schema if isinstance(arg_schema, Mapping) else {})
        default = inspect.Parameter.empty if arg in required else OMITTED
        params.append(
            inspect.Parameter(arg, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=hint)
        )
        annotations[arg] = hint

    def tool(self: ToolHost, **arguments: Any) -> str:
        return self._session.call_tool(name, {k: v for k, v in arguments.items() if v is not OMITTED})

    tool.__name__ = tool.__qualname__ = name
    tool.__doc__ = _docstring(str(function.get("description") or name), properties)
    tool.__annotations__ = annotations  # no "return": get_json_schema would add it to the schema
    tool.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    return tool


def tool_name(schema: ToolSchema) -> str:
    return str(schema.get("function", schema).get("name", ""))
