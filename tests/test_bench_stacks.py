"""A bench's stopped stack is made sure gone by process, never by a pid alone (`bench/stacks.py`).

A stack's jails fork thousands of processes, and the pid space (32,768 on the development
machine) hands their pids out again within seconds of their end. `make_sure_gone` SIGKILLed every
pid of the stack still in use 15 s after the stop, so on a machine shared with other work it could
kill whatever process had been handed one of those pids since. It now checks each pid's start
time, through a pidfd, before it signals.
"""

from __future__ import annotations

import subprocess
import time

from bench.stacks import alive, make_sure_gone, tree_pids


def test_a_pid_now_held_by_another_process_is_left_alone() -> None:
    stranger = subprocess.Popen(["sleep", "30"])
    try:
        started = tree_pids(stranger.pid)[stranger.pid]
        assert alive(stranger.pid, started)
        # The stack's process of that pid started at another time: the pid was handed out again.
        earlier = str(int(started) - 1)
        assert not alive(stranger.pid, earlier)
        began = time.monotonic()
        make_sure_gone({stranger.pid: earlier}, "a stopped stack")
        # Nothing of the stack's left to wait for, and the stranger still runs.
        assert time.monotonic() - began < 5
        assert stranger.poll() is None
    finally:
        stranger.kill()
        stranger.wait()
