"""The two agent-facing renderings of a tool list.

The text form reproduces CodeGym's published `system` prompts byte for byte, so agents trained on
those prompts see the same thing here; the JSON form serves native function calling (OpenAI tool
definitions).
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from codegym.contract.docstring import ArgDoc, shown_lines
from codegym.contract.source import EnvSpec, ToolDef

_SIMPLE_TYPES = {
    "int": "integer",
    "float": "number",
    "str": "string",
    "bool": "boolean",
    "list": "array",
    "List": "array",
    "tuple": "array",
    "Tuple": "array",
    "set": "array",
    "Sequence": "array",
    "dict": "object",
    "Dict": "object",
    "Mapping": "object",
    "None": "null",
}


def tool_text(tool: ToolDef) -> str:
    """One `Function:` block as CodeGym prints it: the `def` line as written without `self`, the
    opening quotes, the docstring's own lines (whitespace-only lines kept, one indentation level
    less, `Example Output` cut: see `shown_lines`), the closing quotes."""
    body = "\n".join(shown_lines(tool.raw_docstring, tool.indent))
    return f'Function:\n\n{tool.header}\n    r"""{body}\n    """\n'


def tools_text(spec: EnvSpec) -> str:
    """The whole tool list as in the `system` message of a CodeGym training instance."""
    return "\n" + "".join(tool_text(t) + "\n" for t in spec.tools) + "\n"


def _type_schema(node: ast.expr | None) -> dict[str, Any]:
    """JSON schema of a type annotation; an empty schema (any value) when it cannot be told."""
    if node is None:
        return {}
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        try:
            return _type_schema(ast.parse(node.value, mode="eval").body)
        except SyntaxError:
            return {}
    if isinstance(node, ast.Constant) and node.value is None:
        return {"type": "null"}
    if isinstance(node, ast.Name | ast.Attribute):
        name = node.id if isinstance(node, ast.Name) else node.attr
        return {"type": _SIMPLE_TYPES[name]} if name in _SIMPLE_TYPES else {}
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _union([_type_schema(node.left), _type_schema(node.right)])
    if isinstance(node, ast.Subscript):
        outer = _type_schema(node.value)
        inner = node.slice
        name = node.value.id if isinstance(node.value, ast.Name) else getattr(node.value, "attr", "")
        if name in ("Optional",):
            return _union([_type_schema(inner), {"type": "null"}])
        if name in ("Union",) and isinstance(inner, ast.Tuple):
            return _union([_type_schema(e) for e in inner.elts])
        if outer.get("type") == "array":
            if isinstance(inner, ast.Tuple):
                items = [
                    _type_schema(e)
                    for e in inner.elts
                    if not (isinstance(e, ast.Constant) and e.value is ...)
                ]
                merged = _union(items) if items else {}
                return {"type": "array", "items": merged} if merged else {"type": "array"}
            item = _type_schema(inner)
            return {"type": "array", "items": item} if item else {"type": "array"}
        return outer
    return {}


def _union(schemas: list[dict[str, Any]]) -> dict[str, Any]:
    if any(not s for s in schemas):
        return {}
    types: list[str] = []
    for s in schemas:
        t = s.get("type")
        if isinstance(t, str) and t not in types:
            types.append(t)
    if len(types) == 1:
        return dict(schemas[0])
    return {"type": types}


def _type_from_text(text: str) -> dict[str, Any]:
    """Type written in an `Args:` line, e.g. `list[int]` or `int, optional`."""
    cleaned = re.sub(r",?\s*optional\s*$", "", text.strip())
    if not cleaned:
        return {}
    try:
        return _type_schema(ast.parse(cleaned, mode="eval").body)
    except SyntaxError:
        return {}


def tool_schema(tool: ToolDef) -> dict[str, Any]:
    """OpenAI function-calling definition of one tool."""
    docs: dict[str, ArgDoc] = {a.name: a for a in tool.docstring.args}
    properties: dict[str, Any] = {}
    required: list[str] = []
    for param in tool.params:
        doc = docs.get(param.arg)
        schema = _type_schema(param.annotation)
        if doc is not None:
            documented = _type_from_text(doc.type_text)
            if not schema or (schema.get("type") == "array" and "items" in documented):
                schema = documented or schema
            if doc.description:
                schema = {**schema, "description": doc.description}
        properties[param.arg] = schema
        if param.arg not in tool.defaults:
            required.append(param.arg)
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": tool.docstring.summary,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


def tools_schema(spec: EnvSpec) -> list[dict[str, Any]]:
    return [tool_schema(t) for t in spec.tools]


def tools_schema_json(spec: EnvSpec) -> str:
    return json.dumps(tools_schema(spec), indent=2, ensure_ascii=False)
