"""What runs on this machine, read from /proc: process trees (jails included), ports, and waiting.

A sandbox worker's jails show up in /proc with host pids, under the worker: worker → nsjail →
zygote (pid 1 of the jail) → the zygote's forks (the spare, resident sessions, one-shot
operations). `process_tree` follows the parent links, so a snapshot of a server's tree holds its
jails' processes too, and a check that every one of them is gone cannot miss a jailed leftover.

Tests wait for the state that stands for an event (a process blocked in `clock_nanosleep` is a
step that has started sleeping) with `wait_until`, never for a fixed time.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

# The /proc reading the benchmarks share (bench/common.py).
from codegym.proctree import children_by_parent, cmdline, stat_fields

# The one wait of the tests and benchmarks, re-exported here where the tests look for it.
from codegym_testkit.waiting import wait_for, wait_until  # noqa: F401

# (pid, start time in clock ticks since boot): a pid alone may be reused by a new process.
Proc = tuple[int, int]
# x86_64 syscall number: what a process in time.sleep() is blocked in.
CLOCK_NANOSLEEP = 230


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def syscall(pid: int) -> int:
    """The syscall the process's main thread is blocked in, or -1 (running, gone, unreadable)."""
    try:
        return int(Path(f"/proc/{pid}/syscall").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return -1


def children(pid: int) -> list[int]:
    return sorted(children_by_parent().get(pid, []))


def process_tree(root: int) -> dict[Proc, str]:
    """`root` and all its descendants (jailed ones included), each with its command line."""
    links = children_by_parent()
    tree: dict[Proc, str] = {}
    stack = [root]
    while stack:
        pid = stack.pop()
        fields = stat_fields(pid)
        line = cmdline(pid)
        if fields is None or line is None:
            continue
        tree[(pid, int(fields[19]))] = line
        stack.extend(links.get(pid, []))
    return tree


def running(proc: Proc) -> bool:
    """The same process (same start time) still exists and is not a zombie waiting to be reaped."""
    fields = stat_fields(proc[0])
    return fields is not None and int(fields[19]) == proc[1] and fields[0] not in ("Z", "X")


def identity(pid: int) -> Proc:
    fields = stat_fields(pid)
    assert fields is not None, f"process {pid} is gone"
    return (pid, int(fields[19]))


def count(tree: dict[Proc, str], needle: str) -> int:
    return sum(needle in line for line in tree.values())


def jailed(root: int) -> list[int]:
    """The processes the zygotes under `root` forked (and theirs): what runs requests and sessions.

    The zygotes themselves are left out: a zygote is the child of an nsjail process."""
    links = children_by_parent()
    nsjails = [pid for pid, _ in process_tree(root) if "nsjail" in (cmdline(pid) or "")]
    found: list[int] = []
    stack = [
        child for nsjail in nsjails for zygote in links.get(nsjail, []) for child in links.get(zygote, [])
    ]
    while stack:
        pid = stack.pop()
        found.append(pid)
        stack.extend(links.get(pid, []))
    return sorted(found)


def sleeping_in_jails(*roots: int) -> list[int]:
    """Jailed processes under `roots` blocked in `time.sleep()`: steps or scripts that have started."""
    return [pid for root in roots for pid in jailed(root) if syscall(pid) == CLOCK_NANOSLEEP]


def listening_ports(pids: set[int]) -> set[int]:
    """TCP ports in LISTEN state whose socket one of `pids` holds open."""
    inodes: set[str] = set()
    for pid in pids:
        try:
            links = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
        except OSError:
            continue
        inodes |= {link[8:-1] for link in links if link.startswith("socket:[")}
    ports: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            next(lines)
            for line in lines:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: TCP_LISTEN
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def port_free(port: int) -> bool:
    """Nothing listens on 127.0.0.1:PORT (SO_REUSEADDR: closed connections in TIME_WAIT do not count)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
            probe.listen()
        except OSError:
            return False
        return True


def assert_all_gone(tree: dict[Proc, str], timeout_s: float = 10.0) -> None:
    """Every process of `tree` (a snapshot) has exited within `timeout_s`."""
    wait_for(lambda: not any(running(p) for p in tree), timeout_s, poll_s=0.05)
    left = {pid: line[:100] for (pid, start), line in tree.items() if running((pid, start))}
    assert left == {}, f"{len(left)} of {len(tree)} processes outlived their server"
