"""Task configs and answers as JSON values: one rule for the jail and for the trusted side.

`codegym.contract` (static checks, the library, export) and the jail (which builds environments
from configs and reports answers) read configs and canonicalize answers with these functions, so
a config the static check accepts is the config the environment gets.
"""

import ast
import json
from typing import Any


class ConfigError(ValueError):
    """A config text that is not a task config."""


def canonical(value: Any) -> Any:
    """A JSON-shaped copy: tuples become lists, sets sorted lists, dict keys strings, numpy values
    Python ones; a float with an integral value becomes an int (so `3.0` and `3` are one answer)."""
    if isinstance(value, bool) or value is None or isinstance(value, str | int):
        return value
    if isinstance(value, float):
        return int(value) if value.is_integer() and abs(value) < 2**53 else value
    if isinstance(value, list | tuple):
        return [canonical(v) for v in value]
    if isinstance(value, set | frozenset):
        items = [canonical(v) for v in value]
        return sorted(items, key=lambda v: json.dumps(v, sort_keys=True))
    if isinstance(value, dict):
        return {str(k): canonical(v) for k, v in value.items()}
    if type(value).__module__ == "numpy" and hasattr(value, "tolist"):
        return canonical(value.tolist())
    raise TypeError(f"answer of type {type(value).__name__} has no JSON form")


def canonical_json(value: Any) -> str:
    return json.dumps(canonical(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def parse_config(text: str) -> dict[str, Any]:
    """A task config: a JSON object (as Python's `json.loads` reads it: NaN and Infinity included),
    or a Python dict literal (CodeGym's own files write env strings with them); keys are strings."""
    if not text.strip():
        raise ConfigError("config is empty (expected a JSON object)")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as json_exc:
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            raise ConfigError(
                f"config is neither JSON nor a Python literal: {json_exc.msg} at position {json_exc.pos}"
            ) from None
    if not isinstance(value, dict):
        raise ConfigError(f"config must be an object, got {type(value).__name__}")
    if not all(isinstance(k, str) for k in value):
        raise ConfigError("config keys must be strings")
    return value
