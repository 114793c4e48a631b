"""Access benchmark: do access tokens (and TLS) cost the step path anything, and does a tenant's
quota hold one trainer's flood away from another's steps?

Each measurement plays bench/rollout_bench.py's rollouts (its Plan, `measure` and Load: the 12
samples' recorded trajectories, think times uniform in [0.5 T, 1.5 T], capacity refusals resent
after their retry-after) on a fresh stack of 2 sandbox workers and 1 runtime on loopback, stopped
by pid when done. Two parts:

  auth     the steady shape (256 rollouts thinking 1 s, 20 s windows) on three stacks:
           "off"  `codegym up`, no tokens;
           "auth" `codegym up --auth`, the clients sending the trainer token it prints (the
                  runtime sends the service token to the workers);
           "tls"  `codegym up --auth --tls-cert C --tls-key K`: tokens and TLS between every
                  process, with a self-signed certificate for 127.0.0.1 (codegym_testkit.access).
           Each stack's clients send the trainer token (and trust the CA) `up` printed for a
           trainer to export.
           Rounds alternate the order (off, auth, tls; then tls, auth, off; ...) for --repeats
           rounds: step p50/p99 per run. Target, for p50 and p99: |median auth - median off| below
           the run-to-run spread (the larger max - min of the two); tls - off is printed beside it.
  tenants  one `codegym up --auth` per round with a tokens file of two trainer tenants: `a` (at
           most 256 sessions, 50 steps/s) and `b` (200 steps/s). b plays the steady shape (128
           rollouts thinking 1 s: 128 steps/s offered) alone, and again while a floods from a
           process of its own (20 rollouts thinking 0.04 s: 500 steps/s offered, ten times its
           quota, each refusal sent again after its retry-after as the clients do); the order
           alternates by round. Figures: b's served/s (and % of N/T: a closed loop falls short of
           it, each episode's create, close and step latencies lie outside the think time), step
           p50/p99; a's served/s, refusals and client CPU over b's run.
           Targets: b served with the flood >= 97 % of its median served alone, in every flooded
           run (what the same rollouts get with nothing in their way is what they offer); b's
           median p99 with the flood <= 1.5 x its median alone (a p99 over a 20 s window rests on
           its ~25 slowest steps and moves by tens of % between runs of one shape: the auth
           part's spread); a served <= its quota plus the one second's burst its bucket holds.
           The runtime's tenant limits are per replica: `up` starts one.

Progress goes to stderr, tables to stdout, every figure to --json FILE.

    .venv/bin/python bench/access_bench.py [--quick] [--parts auth,tenants] [--repeats 3]
        [--steady 256:1] [--tenant-b 128:1] [--flood 20:0.04] [--window-s 20] [--json FILE]

--quick: N/4 at T/4 for the steady shape and b (same offered steps/s), 8 s windows, 2 rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import Figures, Line, median, progress, rusage_cpu_s  # noqa: E402
from bench.episodes import GrpcEpisode  # noqa: E402
from bench.load import CLIENT_TIMEOUT_S, Load, Plan, measure, stop_rollouts  # noqa: E402
from bench.rollout_bench import points  # noqa: E402
from bench.stacks import Stack, StackSpec, git, up  # noqa: E402
from bench.tables import Col, print_table, report_busy  # noqa: E402
from bench.targets import print_targets, spread_verdicts, verdict  # noqa: E402
from codegym.library.location import tokens_path  # noqa: E402
from codegym.server.auth import OPERATOR, SERVICE, TRAINER  # noqa: E402
from codegym_client.async_client import AsyncRuntimeClient  # noqa: E402
from codegym_client.channels import TLS_CA_ENV, TOKEN_ENV  # noqa: E402
from codegym_jobs.oracle import read_trajectories  # noqa: E402
from codegym_testkit.access import printed_access, self_signed  # noqa: E402

PARTS = ("auth", "tenants")
TRAJECTORIES = ROOT / "codegym" / "samples" / "trajectories.jsonl"
QUOTA_A = {"sessions": 256, "steps_per_s": 50}
QUOTA_B = {"steps_per_s": 200}
FLOOD_RAMP_S = 1.0  # a floods this long before b starts: b meets a tenant already past its quota
P99_FACTOR = 1.5  # b's p99 with the flood against alone (see the docstring)
SERVED_PCT = 97.0


# ---------------------------------------------------------------------------------------------
# Part 1: auth off, on, and over TLS.


def failed(exc: Exception) -> Figures:
    return {"failed": f"{type(exc).__name__}: {str(exc)[:300]}"}


def attempt(label: str, run: Callable[[], Figures]) -> Figures:
    """`run()`, or a row saying why it failed (the other runs go on)."""
    try:
        return run()
    except Exception as exc:
        progress(f"!!! {label} failed: {exc}")
        return failed(exc)


def steady_plan(args: argparse.Namespace, n: int, think: float, round_: int) -> Plan:
    return Plan(n, think, args.window_s, args.max_seconds, 50_000, args.seed + round_)


@contextlib.contextmanager
def client_env(token: str, tls_ca: str = "") -> Iterator[None]:
    """`CODEGYM_TOKEN` (and `CODEGYM_TLS_CA`) for the clients made inside the block, as a trainer
    exports them; set only once a stack has started (`up` would take them as its own)."""
    saved = {key: os.environ.get(key) for key in (TOKEN_ENV, TLS_CA_ENV)}
    os.environ[TOKEN_ENV] = token
    if tls_ca:
        os.environ[TLS_CA_ENV] = tls_ca
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def steady_run(spec: StackSpec, lines: list[Line], plan: Plan) -> Figures:
    """`plan` on the stack `spec.up_args` make: "off", "auth" or "tls"."""
    with up(spec) as stack:
        flags = spec.up_args
        printed = printed_access(stack.server.text, auth="--auth" in flags, tls="--tls-cert" in flags)
        with client_env(printed.token, printed.tls_ca):
            return asyncio.run(measure(stack, lines, plan))


def run_auth(
    args: argparse.Namespace, lines: list[Line], workdir: Path, logs: Path, revision: str
) -> list[Figures]:
    cert, key = self_signed(workdir)
    tls = ("--tls-cert", str(cert), "--tls-key", str(key))
    flags: dict[str, tuple[str, ...]] = {"off": (), "auth": ("--auth",), "tls": ("--auth", *tls)}
    n, think = args.steady
    rows = []
    for round_ in range(1, args.repeats + 1):
        for name in ("off", "auth", "tls") if round_ % 2 else ("tls", "auth", "off"):
            progress(f"auth {name}, round {round_}: {n} rollouts thinking {think:g} s")
            library = workdir / f"{name}-{round_}.db"
            spec = StackSpec(name, ROOT, revision, library, logs / f"{name}.log", flags[name])
            plan = steady_plan(args, n, think, round_)
            figures = attempt(f"auth {name}", partial(steady_run, spec, lines, plan))
            progress(
                f"auth {name}: p50 {figures.get('p50_ms') or 0:.1f} ms, p99 {figures.get('p99_ms') or 0:.1f} ms"
            )
            rows.append({"stack": name, "point": f"round {round_}", **figures})
    return rows


# ---------------------------------------------------------------------------------------------
# Part 2: two tenants, one flooding.


def write_tenants(path: Path) -> dict[str, str]:
    """A tokens file `up --auth` keeps as it is (one token of each role, plus a second trainer):
    trainers of tenants a and b with their quotas; the trainer tokens by tenant."""
    tokens = {
        f"cg_bench_{name}_{os.urandom(8).hex()}": (tenant, role)
        for name, tenant, role in (
            ("a", "a", TRAINER),
            ("b", "b", TRAINER),
            ("operator", "ops", OPERATOR),
            ("service", "services", SERVICE),
        )
    }
    body = {
        "tokens": {t: {"tenant": tenant, "role": role} for t, (tenant, role) in tokens.items()},
        "tenants": {"a": QUOTA_A, "b": QUOTA_B},
    }
    path.write_text(json.dumps(body, indent=2))
    path.chmod(0o600)
    return {tenant: t for t, (tenant, role) in tokens.items() if role == TRAINER}


async def flood(address: str, lines: list[Line], plan: Plan) -> None:
    """Tenant a's rollouts (its token in `CODEGYM_TOKEN`), in a process of their own (`--flood-at`)
    so their client never shares b's event loop: "ready" on stdout once they have flooded
    FLOOD_RAMP_S, then a line of their counts so far (and this process's CPU s) for each "mark" on
    stdin; stdin closed ends them."""
    rng = random.Random(plan.seed)
    async with AsyncRuntimeClient(address, timeout_s=CLIENT_TIMEOUT_S) as client:
        await client.wait_ready(60)
        load = Load(lambda: GrpcEpisode(client), lines, plan.think_s, rng, plan.max_episodes)
        tasks = [asyncio.create_task(load.rollout(i, rng.uniform(0, plan.think_s))) for i in range(plan.n)]
        await asyncio.sleep(FLOOD_RAMP_S)
        print("ready", flush=True)
        while (await asyncio.to_thread(sys.stdin.readline)).strip() == "mark":
            print(
                json.dumps({"t": time.monotonic(), "cpu_s": rusage_cpu_s(), **load.tally.counts}), flush=True
            )
        await stop_rollouts(tasks)


@contextlib.contextmanager
def flood_process(
    address: str, token: str, args: argparse.Namespace, seed: int
) -> Iterator[Callable[[], Figures]]:
    """`flood` started in a child process; yields a call that reads its counts now."""
    n, think = args.flood
    argv = [sys.executable, __file__, "--flood-at", address, "--flood", f"{n}:{think}", "--seed", str(seed)]
    child = subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, **{TOKEN_ENV: token}),
        cwd=ROOT,
    )
    assert child.stdin is not None and child.stdout is not None
    stdin, stdout = child.stdin, child.stdout

    def mark() -> Figures:
        stdin.write("mark\n")
        stdin.flush()
        counts: Figures = json.loads(stdout.readline())
        return counts

    try:
        if stdout.readline().strip() != "ready":
            raise RuntimeError("tenant a's flood did not start")
        yield mark
    finally:
        stdin.close()
        try:
            child.wait(40)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def b_with_flood(
    lines: list[Line], plan: Plan, args: argparse.Namespace, token_a: str, stack: Stack
) -> Figures:
    """b's `measure` while a floods from its own process; a's figures over b's whole run."""
    with flood_process(stack.address, token_a, args, plan.seed + 100) as mark:
        before = mark()
        figures = asyncio.run(measure(stack, lines, plan))
        after = mark()
    seconds = after["t"] - before["t"]
    counts = {k: v - before.get(k, 0) for k, v in after.items()}
    n, think = args.flood
    figures.update(
        a_offered=n / think,
        a_served=counts.get("steps", 0) / seconds,
        a_refusals=counts.get("refusals", 0),
        a_refusals_per_s=counts.get("refusals", 0) / seconds,
        a_errors=sum(v for k, v in counts.items() if k.startswith("error:")),
        a_cpu_pct=100 * counts["cpu_s"] / seconds,
        # a's client is this bench's, not other work on the machine (approximate: over b's whole run)
        other_cpu_pct=max(0.0, figures["other_cpu_pct"] - 100 * counts["cpu_s"] / seconds),
        a_seconds=seconds,
    )
    return figures


def tenant_round(args: argparse.Namespace, lines: list[Line], spec: StackSpec, round_: int) -> Figures:
    """b alone and b with a's flood on one stack, in the round's order: figures by phase."""
    n, think = args.tenant_b
    tokens = write_tenants(tokens_path(spec.library))
    plan = steady_plan(args, n, think, round_)
    runs = {
        "alone": partial(measure_now, lines, plan),
        "flood": partial(b_with_flood, lines, plan, args, tokens["a"]),
    }
    out = {}
    with up(spec) as stack, client_env(tokens["b"]):
        for phase in ("alone", "flood") if round_ % 2 else ("flood", "alone"):
            progress(f"tenants, round {round_}: b {n} rollouts thinking {think:g} s, {phase}")
            out[phase] = figures = attempt(f"b {phase}", partial(runs[phase], stack))
            progress(
                f"tenants {phase}: b served {figures.get('served', 0):.1f}/s, p99 "
                f"{figures.get('p99_ms') or 0:.1f} ms, a served {figures.get('a_served', 0):.1f}/s"
            )
    return out


def measure_now(lines: list[Line], plan: Plan, stack: Stack) -> Figures:
    return asyncio.run(measure(stack, lines, plan))


def run_tenants(
    args: argparse.Namespace, lines: list[Line], workdir: Path, logs: Path, revision: str
) -> list[Figures]:
    rows = []
    for round_ in range(1, args.repeats + 1):
        spec = StackSpec(
            "tenants", ROOT, revision, workdir / f"tenants-{round_}.db", logs / "tenants.log", ("--auth",)
        )
        try:
            phases = tenant_round(args, lines, spec, round_)
        except Exception as exc:  # the stack did not start
            progress(f"!!! tenants round {round_} failed: {exc}")
            phases = {phase: failed(exc) for phase in ("alone", "flood")}
        rows += [{"stack": phase, "point": f"round {round_}", **figures} for phase, figures in phases.items()]
    return rows


def tenant_verdicts(rows: list[Figures]) -> list[Figures]:
    alone = [r for r in rows if r["stack"] == "alone" and r.get("p99_ms") is not None]
    flooded = [r for r in rows if r["stack"] == "flood" and r.get("p99_ms") is not None]
    if not alone or not flooded:
        return [verdict("tenants", "measured", "no run measured", False)]
    served_alone = median([r["served"] for r in alone])
    worst = 100 * min(r["served"] for r in flooded) / served_alone
    p99_alone, p99_flood = median([r["p99_ms"] for r in alone]), median([r["p99_ms"] for r in flooded])
    spread = max(r["p99_ms"] for r in alone) - min(r["p99_ms"] for r in alone)
    a_most = max(r["a_served"] for r in flooded)
    a_bound = QUOTA_A["steps_per_s"] * (1 + 1 / min(r["a_seconds"] for r in flooded))
    return [
        verdict(
            "b served with a's flood (worst run)",
            f">= {SERVED_PCT:g} % of alone",
            f"{worst:.1f} % of {served_alone:.1f}/s",
            worst >= SERVED_PCT,
            pct=worst,
        ),
        verdict(
            "b step p99, flood vs alone (medians)",
            f"<= {P99_FACTOR:g} x alone",
            f"{p99_flood:.1f} vs {p99_alone:.1f} ms (alone spread {spread:.1f})",
            p99_flood <= P99_FACTOR * p99_alone,
            flood=p99_flood,
            alone=p99_alone,
            spread=spread,
        ),
        verdict(
            "a served, held to its quota (most)",
            f"<= {a_bound:.1f}/s",
            f"{a_most:.1f}/s",
            a_most <= a_bound,
            served=a_most,
            most=a_bound,
        ),
    ]


# ---------------------------------------------------------------------------------------------
# Tables, command line.

AUTH_COLUMNS = (
    "auth off / on / tls: steady N rollouts thinking T, one fresh stack per run, order alternating",
    [
        Col("served/s", "served"),
        Col("served %", "served_pct", ".1f"),
        Col("p50 ms", "p50_ms", ".2f"),
        Col("p99 ms", "p99_ms", ".1f"),
        Col("CPU ms/step", "cpu_ms_per_step", ".2f"),
        Col("refused", "refusals", "d"),
        Col("errors", "errors", "d"),
        Col("mismatch", "mismatches", "d"),
        Col("other CPU %", "other_cpu_pct"),
    ],
)
TENANT_COLUMNS = (
    "tenants: b's steady shape alone and while a floods ten times its quota (a's figures over b's run)",
    [
        Col("b offered/s", "offered"),
        Col("b served/s", "served"),
        Col("b served %", "served_pct", ".1f"),
        Col("b p50 ms", "p50_ms", ".2f"),
        Col("b p99 ms", "p99_ms", ".1f"),
        Col("b refused", "refusals", "d"),
        Col("b errors", "errors", "d"),
        Col("a offered/s", "a_offered"),
        Col("a served/s", "a_served", ".1f"),
        Col("a refused", "a_refusals", "d"),
        Col("a refused/s", "a_refusals_per_s"),
        Col("a errors", "a_errors", "d"),
        Col("a gen CPU %", "a_cpu_pct"),
        Col("other CPU %", "other_cpu_pct"),
    ],
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    add("--repeats", type=int, help="rounds of each part (3; --quick 2)")
    add("--steady", type=lambda s: points(s)[0], default=(256, 1.0), help="N:T of the auth part")
    add("--tenant-b", type=lambda s: points(s)[0], default=(128, 1.0), help="N:T of tenant b")
    add("--flood", type=lambda s: points(s)[0], default=(20, 0.04), help="N:T of tenant a's flood")
    add("--window-s", type=float, default=20.0, help="steady window after the warm-up, s")
    add("--max-seconds", type=float, default=120.0, help="time cap of each run")
    add("--seed", type=int, default=1)
    add("--json", type=Path, help="also write every figure to this file")
    add("--quick", action="store_true", help="smoke run: N/4 at T/4, 8 s windows, 2 rounds")
    add("--flood-at", default="", help=argparse.SUPPRESS)  # this process is tenant a's flood
    args = parser.parse_args(argv)
    args.parts = [p for p in args.parts.split(",") if p]
    if unknown := set(args.parts) - set(PARTS):
        parser.error(f"unknown parts: {', '.join(sorted(unknown))}")
    args.repeats = args.repeats or (2 if args.quick else 3)
    if args.quick:
        args.steady, args.tenant_b = (
            (max(1, n // 4), max(0.25, t / 4)) for n, t in (args.steady, args.tenant_b)
        )
        args.window_s, args.max_seconds = min(args.window_s, 8.0), min(args.max_seconds, 60.0)
    return args


def main() -> None:
    args = parse_args()
    lines = [line for line in read_trajectories(TRAJECTORIES) if line.get("steps")]
    if args.flood_at:
        n, think = args.flood
        asyncio.run(flood(args.flood_at, lines, Plan(n, think, 0.0, 0.0, 50_000, args.seed)))
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the blocks below stop the servers
    dirty = " + uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else ""
    revision = git("rev-parse", "--short", "HEAD") + dirty
    results: dict[str, list[Figures]] = {}
    verdicts: list[Figures] = []
    with contextlib.ExitStack() as cleanup:
        workdir = Path(tempfile.mkdtemp(prefix="codegym-access-bench-"))
        workdir.chmod(0o755)  # the jails run as other uids
        cleanup.callback(shutil.rmtree, workdir, True)
        logs = Path(tempfile.mkdtemp(prefix="codegym-access-bench-logs-"))
        progress(f"logs in {logs}")
        specs = [StackSpec("new", ROOT, revision, workdir, logs)]
        if "auth" in args.parts:
            results["auth"] = run_auth(args, lines, workdir, logs, revision)
            print_table("auth", results["auth"], specs, AUTH_COLUMNS)
            verdicts += spread_verdicts(results["auth"], "auth", "off")
            verdicts += spread_verdicts(results["auth"], "tls", "off", target=False)
        if "tenants" in args.parts:
            results["tenants"] = run_tenants(args, lines, workdir, logs, revision)
            print_table("tenants", results["tenants"], specs, TENANT_COLUMNS)
            verdicts += tenant_verdicts(results["tenants"])
        print_targets(verdicts)
        report_busy(results)  # contended latencies named
    if args.json:
        meta = {
            "revision": revision,
            "args": vars(args),
            "cpus": os.cpu_count(),
            "loadavg": os.getloadavg(),
            "quotas": {"a": QUOTA_A, "b": QUOTA_B},
        }
        args.json.write_text(
            json.dumps({"meta": meta, "parts": results, "targets": verdicts}, indent=2, default=str)
        )
        progress(f"figures written to {args.json}")


if __name__ == "__main__":
    main()
