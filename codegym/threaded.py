"""A blocking generator driven from the event loop: it runs in a thread, a bounded queue between.

For work that reads a file page by page (a SQLite library of 80,000 tasks) inside an async server:
the loop keeps answering steps while the thread reads, the queue holds at most `depth` items, so
memory stays bounded by the consumer's pace, and a consumer that stops early (a cancelled call)
stops the thread at its next item instead of leaving it blocked.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator

_END = object()


async def iterate_in_thread[T](make: Callable[[], Iterator[T]], depth: int = 2) -> AsyncIterator[T]:
    """The items of `make()` (called in the thread, so it may open thread-bound resources there)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[object] = asyncio.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item: object) -> bool:
        """Hand an item to the loop; False once the consumer has gone."""
        while not stop.is_set():
            future = asyncio.run_coroutine_threadsafe(queue.put(item), loop)
            try:
                future.result(timeout=0.5)
                return True
            except TimeoutError:
                if not future.cancel():  # it went in just now
                    return True
        return False

    def produce() -> None:
        try:
            for item in make():
                if not put(item):
                    return
        except BaseException as exc:  # handed to the consumer, raised there
            put(exc)
            return
        put(_END)

    worker = loop.run_in_executor(None, produce)
    try:
        while True:
            item = await queue.get()
            if item is _END:
                break
            if isinstance(item, BaseException):
                raise item
            yield item  # type: ignore[misc]
    finally:
        stop.set()
        await worker
