"""Client methods whose gRPC failures come out typed (`raises_typed`), and the typed error of a
channel that did not connect in time (`unreachable`): what `RuntimeClient` and `AsyncRuntimeClient`
wrap their calls in. The errors and the table that types them are `errors.py`."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any, ParamSpec, TypeVar, cast

import grpc

from codegym_client.errors import CodeGymError, RuntimeUnavailable, error_class, typed_error

__all__ = ["connect_cause", "raises_typed", "unreachable"]

P = ParamSpec("P")
R = TypeVar("R")


def raises_typed(method: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Turn the raw gRPC errors of a client method (plain, async or generator) into `CodeGymError`s."""

    def wrap(fn: Callable[P, R]) -> Callable[P, R]:
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def run_async(*args: P.args, **kwargs: P.kwargs) -> Any:
                try:
                    return await fn(*args, **kwargs)
                except CodeGymError:
                    raise
                except grpc.RpcError as exc:
                    raise typed_error(exc, method) from exc

            return cast(Callable[P, R], run_async)

        if inspect.isgeneratorfunction(fn):

            @functools.wraps(fn)
            def run_generator(*args: P.args, **kwargs: P.kwargs) -> Any:
                try:
                    return (yield from cast(Iterator[Any], fn(*args, **kwargs)))
                except CodeGymError:
                    raise
                except grpc.RpcError as exc:
                    raise typed_error(exc, method) from exc

            return cast(Callable[P, R], run_generator)

        @functools.wraps(fn)
        def run(*args: P.args, **kwargs: P.kwargs) -> R:
            try:
                return fn(*args, **kwargs)
            except CodeGymError:
                raise
            except grpc.RpcError as exc:
                raise typed_error(exc, method) from exc

        return run

    return wrap


def connect_cause(details: str) -> str:
    """A short reason from the details of a call that could not reach the runtime."""
    low = details.lower()
    for needle, cause in (
        ("connection refused", "connection refused (nothing listens there)"),
        ("domain name not found", "host name not found"),
        ("name or service not known", "host name not found"),
        ("network is unreachable", "network unreachable"),
        ("no route to host", "no route to host"),
        ("connection reset", "connection reset"),
        ("deadline exceeded", "no answer in time"),
        ("timed out", "no answer in time"),
    ):
        if needle in low:
            return cause
    return details or "no answer"


def unreachable(target: str, timeout_s: float, probe: grpc.RpcError) -> RuntimeUnavailable | None:
    """The error of a channel that did not connect in time, or None when the probe got through."""
    code = probe.code()
    if error_class(code, "", "wait_ready") is not RuntimeUnavailable:
        return None  # something answered (the table's "no replica answered in time" says not)
    cause = connect_cause(str(probe.details() or ""))
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        cause = f"no answer after {timeout_s:g} s"
    return RuntimeUnavailable(grpc.StatusCode.UNAVAILABLE, f"cannot reach {target}: {cause}", "wait_ready")
