"""Where a process's CPU went, by stage: py-spy's raw stacks sorted into the stages of a step.

A stack is put in the stage of its leaf-most frame that names one (`RULES`, first match within a
frame); frames no rule names (the interpreter's own C functions, `json`, `base64`, `functools`,
...) are transparent, so their time goes to the code that called them: `json.loads` called by
`sandbox_worker/jail.py` is pipe framing, called by `services/runtime/requests.py` it is reading
the request. A stack no frame of which is named is "interpreter".
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

# (stage, patterns): a frame names the stage when one pattern occurs in it. Checked in this order
# for each frame, so the more specific come first.
RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("env code", ("(<env>", "(<solve>", "gymnasium/")),
    ("pickle", ("pickle", "_pickle", "copyreg")),
    ("fork and spare", ("prefork", "os.fork", "fork (", "_Py_fork", "PyOS_AfterFork")),
    ("jail hygiene", ("hygiene.py", "single_threaded", "kill_leftovers", "wipe_tmp", "reap (")),
    ("resident wake-ups", ("residents.py", "serve_resident", "watchdog.py", "limit_cpu")),
    ("operation in the child", ("inside/operations.py", "inside/values.py", "inside/codecache.py")),
    (
        "pipe framing",
        ("frames.py", "sandbox_worker/jail.py", "inside/messages.py", "zygote.py", "to_result", "_request ("),
    ),
    ("session store", ("runtime/sessions.py", "redis_store.py", "redis/", "idempotency.py")),
    (
        "record",
        ("record_desk.py", "episode_record.py", "record_store.py", "tallies.py", "runtime/curriculum.py"),
    ),
    ("captures and history", ("captures.py", "capture_desk.py", "runtime/history.py", "forking.py")),
    ("auth and tenancy", ("server/auth.py", "tenancy.py", "channels.py")),
    ("metrics", ("prometheus_client", "server/metrics.py")),
    ("logging", ("logging/", "server/logs.py")),
    (
        "dispatch",
        (
            "services/dispatcher.py",
            "services/worker_stream.py",
            "sandbox_calls.py",
            "sandbox_worker/pool.py",
            "scheduling.py",
            "residency.py",
            "sandbox_worker/service.py",
            "sandbox_worker/streaming.py",
            "runtime/service.py",
            "runtime/outcomes.py",
            "runtime/requests.py",
            "runtime/streaming.py",
            "codegym/errors.py",
            "catalog.py",
        ),
    ),
    ("protobuf", ("google/protobuf", "upb_", "_upb", "message.so", "_message")),
    ("gRPC", ("grpc", "cygrpc", "absl")),
    ("event loop", ("uvloop", "asyncio/", "selectors.py", "selector_events", "epoll")),
)
STAGES: tuple[str, ...] = (*(stage for stage, _ in RULES), "gRPC poller thread", "interpreter")
# One line of py-spy's raw format: frames from the root, ';'-separated, then the sample count.
LINE = re.compile(r"^(?P<stack>.*) (?P<count>\d+)$")


# Leaf frames that are not Python work of ours: gRPC's completion-queue poller is a Python thread
# running a C function (its stack ends at `Thread.run`); uvloop runs gRPC's Cython callbacks and the
# loop's own work in C under `Runner.run`. Without --native py-spy sees no deeper.
LEAVES: tuple[tuple[str, str], ...] = (
    ("Thread.run (threading.py", "gRPC poller thread"),
    ("Runner.run (asyncio/runners.py", "event loop"),
)


def stage_of(frames: list[str]) -> str:
    """The stage of a stack (frames from root to leaf)."""
    for prefix, stage in LEAVES:
        if frames and frames[-1].startswith(prefix):
            return stage
    for frame in reversed(frames):
        for stage, patterns in RULES:
            if any(p in frame for p in patterns):
                return stage
    return "interpreter"


def stages(lines: Iterable[str]) -> Counter[str]:
    """Samples by stage, from py-spy's raw output (thread names, when shown, are frames too)."""
    counts: Counter[str] = Counter()
    for line in lines:
        match = LINE.match(line.rstrip("\n"))
        if match is None:
            continue
        counts[stage_of(match["stack"].split(";"))] += int(match["count"])
    return counts


def read_stages(path: Path) -> Counter[str]:
    if not path.exists():
        return Counter()
    with path.open(errors="replace") as f:
        return stages(f)


def leaves(path: Path, stage: str, top: int = 8) -> list[tuple[str, int]]:
    """The leaf-most named frames that took the most samples within one stage (what to look at)."""
    counts: Counter[str] = Counter()
    with path.open(errors="replace") as f:
        for line in f:
            match = LINE.match(line.rstrip("\n"))
            if match is None:
                continue
            frames = match["stack"].split(";")
            if stage_of(frames) != stage:
                continue
            named = next(
                (fr for fr in reversed(frames) if any(any(p in fr for p in ps) for _, ps in RULES)),
                frames[-1],
            )
            counts[named] += int(match["count"])
    return counts.most_common(top)
