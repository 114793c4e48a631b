"""Answer comparison by canonical JSON.

An agent's answer arrives as JSON, the reference answer is a Python value: a tuple and a list with
the same items are the same answer, but `5` and `"5"` are not, unless the environment opts in to
lenient comparison (some tasks ask for numbers as text).
"""

from __future__ import annotations

import json
import math
from typing import Any

# One rule for both sides: the jail reports answers with the same functions (see the module there).
from codegym.inside.values import canonical, canonical_json

__all__ = ["answers_equal", "canonical", "canonical_json"]


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
