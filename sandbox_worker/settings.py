"""The sandbox worker's settings (`SandboxSettings`): its pool of jails, the per-request limits and
the whole-jail limits, each option declared once here (`codegym serve sandbox --help` shows them;
`codegym up` writes them for its workers with `to_argv`).

Standard library only (and the jail's own settings, which are): `codegym --help` reads these
declarations without loading nsjail or gRPC."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace

from codegym.inside.settings import JailSettings
from codegym.server.settings import GrpcAccess, Output, host, log_level, nested, option, port

# One jail per core unless told otherwise (`serve sandbox --jails`, `up --jails`, `pipeline run --jails`).
DEFAULT_JAILS = os.cpu_count() or 2
SANDBOX_PORT = 50061
# How often the cost of a resident session is measured again.
COST_SAMPLE_S = 5.0


@dataclass(frozen=True)
class RequestLimits:
    """Per-request limits (the proto's `Limits`); the worker's are the defaults of a request that
    names none."""

    wall_ms: int = option(5_000, "--wall-ms", "wall-clock limit per request")
    cpu_ms: int = option(5_000, "--cpu-ms", "CPU limit per request")
    memory_mb: int = option(
        256, "--memory-mb", "memory a request may add to the pre-loaded interpreter (RLIMIT_AS)"
    )
    output_bytes: int = option(64 * 1024, "--output-bytes", "cap on captured stdout and stderr, each")

    def capped(self, maximum: RequestLimits) -> RequestLimits:
        """Zero means default; anything above the maximum is cut to it."""
        return RequestLimits(
            **{f.name: min(getattr(self, f.name), getattr(maximum, f.name)) for f in fields(RequestLimits)}
        )

    def merged(self, maximum: RequestLimits, **asked: int) -> RequestLimits:
        """These limits (the defaults) overridden by the non-zero values asked for, capped at `maximum`."""
        return replace(self, **{k: v for k, v in asked.items() if v}).capped(maximum)


DEFAULT_LIMITS = RequestLimits()
MAX_LIMITS = RequestLimits(wall_ms=60_000, cpu_ms=60_000, memory_mb=1024, output_bytes=1024 * 1024)


@dataclass(frozen=True)
class JailLimits:
    """Whole-jail limits: they bound a jail's zygote plus the request it is serving."""

    # On top of these, a jail gets room for its resident sessions (`JailSettings.resident_cap`
    # processes, three fds each in the zygote, its share of the resident memory budget).
    memory_mb: int = option(
        1536, "--jail-memory-mb", "cgroup memory limit of a whole jail (zygote + request)"
    )
    # What a request may start (and a fork bomb is stopped at).
    pids: int = option(128, "--jail-pids", "process limit of a whole jail (cgroup pids and RLIMIT_NPROC)")
    open_files: int = 512
    file_size_mb: int = 1
    tmpfs_mb: int = 8
    # How much nicer than the worker its jails run (added to the worker's own nice, at most 19).
    # nsjail's own default is an absolute 19: a jail then gets about 1/70 of a nice-0 process's CPU
    # share whenever both want one, and every step, which passes through a jail, waits out the
    # worker, the runtime and anything else busy on the machine. At 0 a jail shares the CPU evenly
    # with its worker: a request that spins is stopped by its CPU limit, and it cannot lower its
    # nice (no CAP_SYS_NICE outside its user namespace). Raise it to favour the trusted processes
    # where the jails' latency matters less than theirs.
    nice: int = option(
        0,
        "--jail-nice",
        "how much nicer than the worker its jails run (0: an even share of the CPU; 19: only what the "
        "trusted processes leave, and every step waits for them under load)",
        choices=tuple(range(0, 20)),
        metavar="0..19",
    )


@dataclass(frozen=True)
class SandboxSettings:
    """Everything `codegym serve sandbox` is told; `SandboxWorker` takes it."""

    host: str = host()
    port: int = port(SANDBOX_PORT)
    jails: int = option(DEFAULT_JAILS, "--jails", "long-lived jails in the pool")
    defaults: RequestLimits = nested(RequestLimits)
    jail: JailLimits = nested(JailLimits)
    max_pending: int = option(
        0, "--max-pending", "operations queued or running before RESOURCE_EXHAUSTED (0 = 256 per jail)"
    )
    resident_memory_mb: int = option(
        0,
        "--resident-memory-mb",
        "memory this worker spends on resident sessions (live envs kept between steps), shared by its "
        "jails; each jail holds its share divided by what a resident is measured to cost. A bound, "
        "not a target: residents are the sessions that stepped within --resident-idle-s, and this "
        "caps them when more step that often than it pays for. Set it from the pod's memory limit; "
        "0 = half the memory this worker may use (its cgroup limit, else the machine's)",
    )
    resident_cap: int = option(
        0,
        "--resident-cap",
        "most resident sessions per jail (0 = 1,024, the jail's ceiling; the memory budget may hold fewer)",
    )
    resident_idle_s: float = option(
        0.0,
        "--resident-idle-s",
        "a session whose steps come further apart than this gets no resident (its steps run one-shot, "
        "cold from the committed state), and a resident idle twice this long goes. 0 = derived: a "
        "resident is kept "
        "while the CPU it saves its next step (a cold step's 6.5 ms minus a warm one's 1.7 ms, "
        "bench/step_cost_bench.py) is worth more than its memory, one CPU being worth the memory per "
        "CPU this worker may use: 4.8 ms x memory per CPU / a resident's measured memory (37 s at 12 GiB "
        "per CPU and 1.6 MiB; 13 s at 4 GiB per CPU), within 2..600 s",
    )
    resident_sample_s: float = option(
        COST_SAMPLE_S,
        "--resident-sample-s",
        "how often the memory of a resident session is measured again (until then it is taken as 3 MiB)",
    )
    source_cache_mb: int = option(
        64,
        "--source-cache-mb",
        "environment sources this worker keeps (callers send a cached source by its sha256 alone)",
    )
    code_cache_mb: int = option(
        JailSettings.code_cache_bytes >> 20,
        "--code-cache-mb",
        "compiled environment code each jail keeps (a source new to a jail costs a compile)",
    )
    admit_idle_s: float = option(
        JailSettings.admit_idle_s,
        "--admit-idle-s",
        "when a jail is full, a resident idle this long gives its place to a newcomer (which otherwise "
        "runs cold, one-shot); longer than an agent's turn, so playing episodes stay warm",
    )
    mortal_preloads: bool = option(
        False,
        "--mortal-preloads",
        "leave the zygotes' preloaded objects mortal: each fork's children and the zygote then copy a "
        "page each time they count a reference to one (about 15 %% more jail CPU per cold step and 25 %% "
        "more memory per resident, docs/benchmarks.md); for measuring what immortal ones save",
    )
    log_level: str = log_level()
    output: Output = nested(Output)
    access: GrpcAccess = nested(GrpcAccess)
