"""Waiting for the state that stands for an event, never for a fixed time: the one `wait_until`
of the tests (and `wait_for`, its form that answers instead of failing)."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(condition: Callable[[], bool], timeout_s: float, poll_s: float = 0.01) -> bool:
    """Whether `condition` became true within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.01) -> float:
    """Seconds until `condition` held (a test may bound how long a thing took); fails the test
    naming `what` after `timeout_s`."""
    started = time.monotonic()
    if not wait_for(condition, timeout_s, poll_s):
        raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
    return time.monotonic() - started
