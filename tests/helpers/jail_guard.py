"""The check behind the `jail` marker: a test not marked `jail` must start no jail.

`-m "not jail"` is the part of the suite that runs without root and without nsjail, and quickly;
a test that starts a sandbox worker (`serve sandbox`, `codegym up`, `sandbox run` without
`--target`, `pipeline run` without `--sandbox`, a `JailPool`) but is not marked would make that
part slow, or fail where jails cannot run. So while an unmarked test sets up and runs, a thread
watches this process's descendants, and a new nsjail process among them fails the test.

Only jails started during the test count, and only those not under a process that was already
there: a worker a module fixture started for an earlier (marked) test may replace one of its jails
at any time. /proc/PID/task/TID/children lists each thread's children, so a walk from this process
costs a few reads while it has no child, which is the case of the fast tests.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from codegym.proctree import cmdline, stat_fields
from tests.helpers.processes import Proc, comm

POLL_S = 0.02


def _children(pid: int) -> list[int]:
    found: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return found
    for task in tasks:
        try:
            found.extend(int(c) for c in (task / "children").read_text().split())
        except (OSError, ValueError):
            continue
    return found


def _identity(pid: int) -> Proc | None:
    """(pid, start time): a pid alone may be reused; None once it is gone."""
    fields = stat_fields(pid)
    return None if fields is None else (pid, int(fields[19]))


def supported() -> bool:
    """Whether this kernel lists children in /proc (CONFIG_PROC_CHILDREN); without it, no check."""
    return Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").exists()


class JailWatch:
    """Watch for nsjail processes started under this process from now until `stop()`."""

    def __init__(self) -> None:
        self.root = os.getpid()
        self.before = {p for p in map(_identity, self._descendants()) if p is not None}
        self.started: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jail-watch", daemon=True)
        self._thread.start()

    def _descendants(self) -> list[int]:
        found: list[int] = []
        stack = [self.root]
        while stack:
            children = _children(stack.pop())
            found.extend(children)
            stack.extend(children)
        return found

    def _scan(self) -> None:
        # (pid, whether a process above it, this one excluded, was there before the test)
        stack = [(self.root, False)]
        while stack:
            pid, under_old = stack.pop()
            for child in _children(pid):
                identity = _identity(child)
                if identity is None:
                    continue
                old = identity in self.before
                if not old and not under_old and comm(child) == "nsjail":
                    line = (cmdline(child) or "").strip()
                    self.started.append(f"pid {child}: {line[:120] or 'nsjail'}")
                    self.before.add(identity)  # reported once, its jail's processes not at all
                    continue
                stack.append((child, under_old or old))

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            self._scan()

    def stop(self) -> list[str]:
        """The nsjail processes the test started (empty: none)."""
        self._stop.set()
        self._thread.join()
        self._scan()
        return self.started
