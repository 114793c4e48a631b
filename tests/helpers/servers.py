"""Start our servers as real processes on loopback port 0, and stop them by pid."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

ADDRESS = re.compile(r"listening on (127\.0\.0\.1:\d+)")


class ServerProcess:
    def __init__(self, args: list[str], timeout: float = 60.0, python: str = sys.executable) -> None:
        self.proc = subprocess.Popen(
            [python, "-m", "codegym_cli.cli", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        self.output: list[str] = []
        self.address = ""
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.output.append(line)
            match = ADDRESS.search(line)
            if match:
                self.address = match.group(1)
                break
        if not self.address:
            self.stop()
            raise RuntimeError("server did not start:\n" + "".join(self.output))
        # Keep reading, so a chatty server never blocks on a full pipe; tests can inspect the text.
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)

    @property
    def text(self) -> str:
        return "".join(self.output)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        return self.proc.returncode


@contextmanager
def running(args: list[str]) -> Iterator[ServerProcess]:
    server = ServerProcess(args)
    try:
        yield server
    finally:
        server.stop()
