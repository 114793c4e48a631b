"""Forms built from a tool's JSON schema (the OpenAI function definition the runtime serves), and
the action they post back.

A field per parameter: numbers, integers, booleans and strings get inputs of their type, anything
else (arrays, objects) a JSON text area. The posted form becomes the tool call's parameters; a
field that does not parse is named in a clear error, and the raw JSON box takes any action as is.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Field:
    name: str
    kind: str  # "integer", "number", "boolean", "string", "json"
    required: bool
    description: str


@dataclass(frozen=True)
class ToolForm:
    name: str
    description: str
    fields: list[Field]
    schema_text: str  # the schema as the trainer's model sees it, pretty-printed


SIMPLE = ("integer", "number", "boolean", "string")


def tool_form(name: str, json_schema: str) -> ToolForm:
    """The form of one tool from its served JSON schema (an unreadable schema: a JSON box only)."""
    try:
        schema = json.loads(json_schema) if json_schema else {}
    except json.JSONDecodeError:
        schema = {}
    function = schema.get("function", schema) if isinstance(schema, dict) else {}
    params = function.get("parameters", {}) if isinstance(function, dict) else {}
    properties = params.get("properties", {}) if isinstance(params, dict) else {}
    required = set(params.get("required", [])) if isinstance(params, dict) else set()
    fields = []
    for key, spec in properties.items() if isinstance(properties, dict) else ():
        spec = spec if isinstance(spec, dict) else {}
        kind = spec.get("type")
        fields.append(
            Field(
                str(key),
                kind if kind in SIMPLE else "json",
                key in required,
                str(spec.get("description", "")),
            )
        )
    pretty = json.dumps(schema, indent=2, ensure_ascii=False) if schema else json_schema
    return ToolForm(
        name, str(function.get("description", "")) if isinstance(function, dict) else "", fields, pretty
    )


class BadForm(ValueError):
    """A form field that does not hold a value of its type."""


def parameters(form: ToolForm, posted: Mapping[str, str]) -> dict[str, Any]:
    """The tool call's parameters from a posted form (`p.NAME` fields); empty optional fields are left out."""
    values: dict[str, Any] = {}
    for field in form.fields:
        raw = posted.get(f"p.{field.name}", "")
        if field.kind == "boolean":
            values[field.name] = raw in ("on", "true", "1")
            continue
        if raw == "" and not field.required:
            continue
        try:
            if field.kind == "integer":
                values[field.name] = int(raw)
            elif field.kind == "number":
                values[field.name] = float(raw)
            elif field.kind == "string":
                values[field.name] = raw
            else:
                values[field.name] = json.loads(raw)
        except ValueError as exc:
            raise BadForm(f"parameter {field.name!r} is not a {field.kind}: {exc}") from None
    return values
