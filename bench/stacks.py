"""The stacks a bench measures: which code (`StackSpec`: a base commit in a worktree, or the
working tree) and one running `codegym up` of it (`Stack`, started by `up`).

Every bench that runs `codegym up` runs it here, so every stack is started the same way (the
shared server lifecycle, `bench.common.start_process`), runs the code it says it runs (a base
that imported the venv's editable installs would measure the new code twice: `check_imports`),
and leaves no process behind however the bench ends (`make_sure_gone`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from bench.common import progress, start_process
from codegym import proctree
from codegym.procs import RedisServer, ServerProcess

ROOT = Path(__file__).resolve().parent.parent
GATEWAY_LINE = re.compile(r"openenv gateway at (\S+:\d+)")
# A server's line in `codegym up`'s output: at start and after each restart.
SERVER_LINE = re.compile(
    r"(runtime \d+|sandbox worker \d+|openenv gateway|redis) (?:back )?at (\S+) \(pid (\d+)[);]"
)


@dataclass
class StackSpec:
    """Which code a stack runs: `tree` (a checkout) first on PYTHONPATH, from `tree` as cwd."""

    name: str  # "base" or "new"
    tree: Path
    revision: str  # what the tables say it is
    library: Path  # built by the stack's first `codegym up`, from its own sample environments
    log: Path  # the servers' stderr (their logs), for a post-mortem
    up_args: tuple[str, ...] = ()  # more `codegym up` options for this stack (--up-args)

    @property
    def env(self) -> dict[str, str]:
        # The venv holds editable installs of the working tree; PYTHONPATH comes before them (the
        # editable finder is appended to sys.meta_path), so the tree's modules are imported.
        return dict(os.environ, PYTHONPATH=f"{self.tree}:{self.tree / 'clients'}")


class Stack:
    """A running `codegym up`: its process (CPU and memory are read from its tree), its addresses,
    and each of its servers' address and current pid, read from the lines `up` prints for them at
    start and after each restart. `redis` is a Redis of the bench's own that `up` was given
    (`--sessions`), started and stopped by the bench."""

    def __init__(self, server: ServerProcess, openenv_url: str = "") -> None:
        self.server = server
        self.address = server.address
        self.openenv_url = openenv_url
        self.redis: RedisServer | None = None

    @property
    def pid(self) -> int:
        """`codegym up`'s pid: its tree holds the stack's servers (`cpu_by_role` reads it)."""
        return self.server.pid

    @property
    def runtimes(self) -> list[str]:
        return self.address.split(",")

    def servers(self) -> dict[str, tuple[str, int]]:
        """Each server's name → (address, pid), the latest line for each (`up` keeps the lines)."""
        return {name: (address, int(pid)) for name, address, pid in SERVER_LINE.findall(self.server.text)}

    def server_pid(self, name: str) -> int:
        return self.servers()[name][1]

    async def restarted(self, name: str, old_pid: int, timeout_s: float = 90.0) -> None:
        """Wait until `codegym up` says `name` is back under a new pid."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.servers().get(name, ("", old_pid))[1] != old_pid:
                return
            await asyncio.sleep(0.2)
        raise RuntimeError(f"{name} did not come back within {timeout_s:.0f} s")


def git(*args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True
    ).stdout.strip()


def check_imports(spec: StackSpec) -> None:
    """Fail unless `python` under the stack's env imports the servers and the client from its tree.

    The editable installs of the venv point at the working tree: a base that silently imported them
    would measure the new code twice.
    """
    # The packages the tree has (a base from before a package existed has none of it to import).
    packages = ("codegym", "codegym_jobs", "codegym_cli", "codegym_client", "sandbox_worker", "services")
    modules = [m for m in packages if (spec.tree / m).is_dir() or (spec.tree / "clients" / m).is_dir()]
    code = f"import {', '.join(modules)}; " + "; ".join(f"print({m}.__file__)" for m in modules)
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=spec.tree, env=spec.env, capture_output=True, text=True, check=True
    ).stdout.split()
    stray = [path for path in out if not Path(path).resolve().is_relative_to(spec.tree.resolve())]
    if stray or len(out) != len(modules):
        raise RuntimeError(f"{spec.name} stack imports modules from outside {spec.tree}: {stray or out}")
    progress(f"{spec.name}: python under its env imports {', '.join(modules)} from {spec.tree}")


@contextlib.contextmanager
def base_worktree(rev: str) -> Iterator[Path]:
    """REV checked out (`git worktree add --detach`) in a temp dir, removed however the bench ends.

    The temp dir is made traversable by others: the jails run as other uids and mount
    the jail's package (codegym/inside) from the imported package's path.
    """
    folder = Path(tempfile.mkdtemp(prefix="codegym-rollout-base-"))
    folder.chmod(0o755)
    tree = folder / "tree"
    try:
        git("worktree", "add", "--detach", "--quiet", str(tree), rev)
        yield tree
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            git("worktree", "remove", "--force", str(tree))
        shutil.rmtree(folder, ignore_errors=True)
        with contextlib.suppress(subprocess.CalledProcessError):
            git("worktree", "prune")


def add_tree_options(parser: argparse.ArgumentParser) -> None:
    """`--base REV` and `--no-base`: which commit a bench compares the working tree with."""
    parser.add_argument("--base", default="main", help="the commit to compare with (default main)")
    parser.add_argument("--no-base", action="store_true", help="measure the working tree only")


def compared_trees(args: argparse.Namespace, cleanup: contextlib.ExitStack) -> dict[str, Path]:
    """The checkouts a bench that starts its own processes runs, base first, by the name its
    tables print: the base commit in a worktree (unless --no-base), then the working tree."""
    trees: dict[str, Path] = {}
    if not args.no_base:
        trees[f"base {git('rev-parse', '--short', args.base)}"] = cleanup.enter_context(
            base_worktree(args.base)
        )
    dirty = " + changes" if git("status", "--porcelain", "--untracked-files=no") else ""
    trees[f"new {git('rev-parse', '--short', 'HEAD')}{dirty}"] = ROOT
    return trees


def stack_specs(args: argparse.Namespace, cleanup: contextlib.ExitStack, workdir: Path) -> list[StackSpec]:
    """The stacks to measure, base first: ("base" unless --no-base, "new")."""
    head = git("rev-parse", "--short", "HEAD")
    dirty = " + uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else ""
    specs = []
    if not args.no_base:
        tree = cleanup.enter_context(base_worktree(args.base))
        base_rev = git("rev-parse", "--short", args.base)
        specs.append(StackSpec("base", tree, base_rev, workdir / "base.db", workdir / "base.log"))
    # Options both stacks run with (the shape's, not the change's): `--runtimes N` replicas share
    # their sessions in a Redis `codegym up` starts, so the store's reads and writes show.
    both = ("--runtimes", str(args.runtimes)) if getattr(args, "runtimes", 1) > 1 else ()
    if specs:
        specs[0].up_args = both
    up_args = (*both, *args.up_args.split())
    revision = f"{head}{dirty}" + (f" {args.up_args}" if args.up_args else "")
    specs.append(StackSpec("new", ROOT, revision, workdir / "new.db", workdir / "new.log", up_args))
    for spec in specs:
        check_imports(spec)
    return specs


def tree_pids(root: int) -> dict[int, str]:
    """A process and its descendants now, each with its start time: a pid is handed out again once
    its process is gone (a stack's jails fork thousands, and the pid space is 32,768 here), so
    only the process with that pid and that start time is the stack's."""
    found = {}
    for pid in proctree.descendants([root]):
        fields = proctree.stat_fields(pid)
        if fields is not None:
            found[pid] = fields[19]
    return found


def alive(pid: int, started: str) -> bool:
    """Whether the process that had `pid` and started at `started` still runs."""
    fields = proctree.stat_fields(pid)
    return fields is not None and fields[0] != "Z" and fields[19] == started


def make_sure_gone(pids: dict[int, str], name: str) -> None:
    """Every process of a stopped stack must be gone: wait a little, then SIGKILL stragglers by pid,
    each checked to be the stack's own process (by start time) right before: a pid of the stack's
    that another process took since (another bench's test run, a compiler) is never killed."""
    deadline = time.monotonic() + 15
    while (left := {p for p, started in pids.items() if alive(p, started)}) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:
        try:
            handle = os.pidfd_open(pid)
        except OSError:  # gone meanwhile
            continue
        try:
            # Checked through the handle's process: the signal cannot reach a pid's next owner.
            if alive(pid, pids[pid]):
                progress(f"!!! {name}: pid {pid} outlived its stack; SIGKILL")
                signal.pidfd_send_signal(handle, signal.SIGKILL)
        except ProcessLookupError:
            pass
        finally:
            os.close(handle)


def gateway_address(server: ServerProcess, timeout_s: float = 30.0) -> str:
    """The OpenEnv gateway's address, from `codegym up`'s line after its ready line."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in server.output:
            match = GATEWAY_LINE.search(line)
            if match:
                return match.group(1)
        if server.proc.poll() is not None:
            break
        time.sleep(0.1)
    raise RuntimeError(f"no OpenEnv gateway line from {server.name}:\n{server.text[-2000:]}")


@contextlib.contextmanager
def up(spec: StackSpec, *, openenv: bool = False, keep: int = 200) -> Iterator[Stack]:
    """`codegym up` of a stack (2 workers, 1 runtime, loopback, and `spec.up_args`), stopped by pid
    when the block ends with every process it started; `keep`: the lines of its output kept."""
    argv = [
        "-m",
        "codegym_cli.cli",
        "up",
        "--library",
        str(spec.library),
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--workers",
        "2",
    ]
    if openenv:
        argv += ["--openenv-port", "0"]
    argv += spec.up_args
    with open(spec.log, "ab") as log:
        server = start_process(
            argv,
            name=f"codegym up ({spec.name})",
            env=spec.env,
            cwd=spec.tree,
            stderr=log.fileno(),
            keep=keep,
            timeout_s=180,
        )
        pids = tree_pids(server.pid)
        try:
            url = f"ws://{gateway_address(server)}/ws" if openenv else ""
            yield Stack(server, url)
        finally:
            pids |= tree_pids(server.pid)  # the jails' children forked during the run too
            server.stop()
            make_sure_gone(pids, server.name)
