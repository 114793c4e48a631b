"""Answer comparison by canonical JSON.

An agent's answer arrives as JSON, the reference answer is a Python value: a tuple and a list with
the same items are the same answer, but `5` and `"5"` are not, unless the environment opts in to
lenient comparison (some tasks ask for numbers as text).
"""

from __future__ import annotations

import json
import math
from typing import Any


def canonical(value: Any) -> Any:
    """A JSON-shaped copy: tuples become lists, sets sorted lists, dict keys strings."""
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
    raise TypeError(f"answer of type {type(value).__name__} has no JSON form")


def canonical_json(value: Any) -> str:
    return json.dumps(canonical(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _lenient_form(value: Any) -> Any:
    if isinstance(value, str):
        text = value.strip()
        try:
            return canonical(json.loads(text))
        except (json.JSONDecodeError, TypeError):
            return text
    return value


def answers_equal(answer: Any, reference: Any, *, lenient: bool = False) -> bool:
    """Whether `answer` is `reference` under canonical JSON equality."""
    try:
        a, b = canonical(answer), canonical(reference)
    except TypeError:
        return bool(answer == reference)
    if _same(a, b):
        return True
    if lenient:
        return _same(_lenient_form(a), _lenient_form(b))
    return False
