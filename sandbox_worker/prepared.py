"""An operation made ready for a jail: what the unary calls and the stream hand to the pool."""

from __future__ import annotations

from typing import NamedTuple

from codegym.inside.messages import Request


class Prepared(NamedTuple):
    """An operation as its jail gets it, its wall-clock limit, and for a step the time its session
    sat idle before it (the runtime's `StepOp.idle_ms`; 0 for anything else)."""

    request: Request
    wall_ms: int
    idle_ms: int = 0
