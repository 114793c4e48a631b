"""Soak with faults: episodes through the trainer paths, all at once, while infrastructure fails.

A training run lives for hours through deploys, scale-in and blips. This runs `codegym up
--runtimes 2 --workers 2 --openenv-port 0` over the Redis that `up` starts for itself (its
append-only file beside the library, supervised by `up`; `--redis given`: a Redis of the soak's own
given through `--sessions`, also append-only) and plays recorded oracle trajectories (codegym/samples/trajectories.jsonl)
through each path, with think time between steps, while a schedule of faults runs in a loop:

  rolling restart   each runtime replica sent SIGTERM in turn (`codegym up` starts it again on
                    its port), the next once the first answers again
  worker killed     a sandbox worker SIGKILLed
  worker drained    a sandbox worker sent SIGTERM (scale-in)
  worker frozen     a sandbox worker stopped with SIGSTOP for 15 s, then SIGCONT
  gateway restart   the OpenEnv gateway sent SIGTERM
  redis restart     up's own Redis SIGKILLed (`up` starts it again on its port and file); with
                    `--redis given`, the soak's Redis stopped and started again the same way

Paths, all at once:

  client   the async client as the trainer adapters drive it (`--rollouts` episodes in flight):
           every call through `codegym_client.outages.ride_out_async`, steps sent with their index;
           `--moves-share` of its episodes, at a random step, fork 2 ways (the rest played in
           both forks, each judged as an episode) or suspend (checkpoint close=True) and go on in
           a restore of the blob (bench/soak_paths.py's `MovingEpisode`)
  trl      TRL's own `GRPOTrainer` training on `CodeGymSpec`'s `environment_factory` with a
           scripted model (bench/soak_trl.py, a process in the trainers' venv)
  verl     verl's own agent loop machinery running `CodeGymAgentLoop` (bench/soak_verl.py, a
           process in the trainers' venv, `--rollouts` episodes in flight)
  openenv  a WebSocket per episode through the gateway, as OpenEnv's EnvClient opens them

The trainers need torch: their venv is built by `make test-trainers` (`--trainers-python`).
Without it, the trl and verl paths run the adapters' contract in this process instead: the
spec's environment class called from threads as TRL's tool loop calls it, and verl's
`run_episode` with a thinking scripted model. The report says which ran.

Every episode is captured (`--capture 1`) into a small store (`--capture-bytes`, 256 KiB), so its
bound is reached within minutes and held through the faults: the store is read every few seconds
(bench/soak_captures.py) and its bytes, as counted and as recounted from the captures, must stay
within the bound, and match at the end.

Per path it reports episodes finished; episodes **shaped** by a fault (an observation that differs
from the recording: must be 0 — a trainer cannot tell it from a true one); episodes **failed** by
the infrastructure and marked so the trainer does not learn from them (TRL: `get_reward()` is
None; verl: `infrastructure_failure`, its row masked); episodes lost (an error escaped to the
trainer: a TRL `InfrastructureFailure` ends the run, an exception out of verl's episode fails its
worker; must be 0 on the trainer paths); trainer processes that died (must be 0); and at the end
the sessions left open in Redis (must be 0 once every episode closed its own; those the client
path was never handed by an answer are a fork or restore done twice by a resend: duplicated), forks
and restores answered at another step or count than asked (must be 0), and the PSS of every
server at start and end (growth within `--memory-growth-mib`). It exits 1 when any of these
fails, after the report. Each episode is judged against its recording by bench/judge.py; the
stack and its faults are bench/soak_stack.py, the paths bench/soak_paths.py.

    .venv/bin/python bench/soak.py [--minutes 20] [--rollouts 16] [--think-s 1] [--faults all]
        [--paths all] [--redis up|given] [--auth] [--trainers-python .venv-trainers/bin/python]
        [--capture 1] [--capture-bytes 262144]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import Line  # noqa: E402
from bench.episodes import WsEpisode  # noqa: E402
from bench.soak_captures import CaptureWatch, final_reading, print_watch, watch  # noqa: E402
from bench.soak_paths import (  # noqa: E402
    Moves,
    MovingEpisode,
    PathTally,
    RidingEpisode,
    TrlEpisode,
    rollout,
    trainer_process,
    verl_rollout,
)
from bench.soak_stack import FAULTS, fault_loop, gateway_url, memory_mib, redis_url, soak_stack  # noqa: E402
from bench.stacks import Stack  # noqa: E402
from codegym_client.async_client import AsyncRuntimeClient  # noqa: E402
from codegym_client.channels import TOKEN_ENV  # noqa: E402
from codegym_client.trl import CodeGymSpec  # noqa: E402
from codegym_jobs.oracle import read_trajectories  # noqa: E402
from codegym_testkit.trainer_script import ability  # noqa: E402

PATHS = ("client", "trl", "verl", "openenv")
TRAINER_PATHS = ("client", "trl", "verl")
# The trainers themselves, each in the trainers' venv (`make test-trainers` builds it): TRL's
# GRPOTrainer over CodeGymSpec, verl's CodeGymAgentLoop. Without that venv, the trl and verl paths
# run the adapters' contract in this process instead (TrlEpisode, verl_rollout).
TRAINER_SCRIPTS = {"trl": "soak_trl.py", "verl": "soak_verl.py"}
TRAINERS_PYTHON = ROOT / ".venv-trainers" / "bin" / "python"
# What a server may gain over a soak: allocator slack and caches (the environments' compiled code,
# the affinity map). A worker's session processes are counted apart (soak_stack.memory_mib).
MEMORY_GROWTH_MIB = 64.0


async def soak(args: argparse.Namespace, stack: Stack, lines: list[Line], workdir: Path) -> dict[str, Any]:
    until = time.monotonic() + args.minutes * 60
    chosen = PATHS if args.paths == "all" else tuple(p for p in args.paths.split(",") if p)
    tallies = {name: PathTally() for name in chosen}
    trainers = Path(args.trainers_python).exists()
    faults_log: list[str] = []
    memory_start = memory_mib(stack)
    captured = CaptureWatch(args.capture_bytes)
    target = ",".join(stack.runtimes)
    # Each trainer path has its own client, as separate trainer processes would.
    async with (
        AsyncRuntimeClient(target, timeout_s=60) as client,
        AsyncRuntimeClient(target, timeout_s=60) as verl_client,
    ):
        await client.wait_ready(60)
        spec = CodeGymSpec(
            target,
            instances=[{"ability": ability(line)} for line in lines],
            outage_wait_s=args.outage_wait_s,
        )
        pool = ThreadPoolExecutor(max_workers=max(1, args.rollouts), thread_name_prefix="trl")
        moves = Moves()
        moving = random.Random(99)
        paths: dict[str, Callable[[], RidingEpisode | WsEpisode | TrlEpisode]] = {
            "client": lambda: MovingEpisode(
                client, tallies["client"], moves, moving, args.think_s, args.moves_share
            ),
            "trl": lambda: TrlEpisode(spec, pool),
            "openenv": lambda: WsEpisode(gateway_url(stack), os.environ.get(TOKEN_ENV, "")),
        }
        tasks = []
        for seed, name in enumerate(chosen):
            if name in TRAINER_SCRIPTS and trainers:
                tallies[name].mode = TRAINER_SCRIPTS[name]
                log = workdir / f"{name}.log"
                tasks.append(
                    asyncio.create_task(
                        trainer_process(name, TRAINER_SCRIPTS[name], args, target, tallies[name], log)
                    )
                )
                continue
            for i in range(args.rollouts):
                if name == "verl":
                    play = verl_rollout(
                        verl_client,
                        lines,
                        tallies[name],
                        args.think_s,
                        until,
                        seed * 1000 + i,
                        args.outage_wait_s,
                    )
                else:
                    play = rollout(paths[name], lines, tallies[name], args.think_s, until, seed * 1000 + i)
                tasks.append(asyncio.create_task(play))
        faults = FAULTS if args.faults == "all" else tuple(f for f in args.faults.split(",") if f)
        tasks.append(asyncio.create_task(fault_loop(stack, list(faults), until - 30, faults_log)))
        ended = asyncio.Event()
        watching = asyncio.create_task(watch(lambda: redis_url(stack), captured, ended))
        try:
            await asyncio.gather(*tasks)
        finally:
            ended.set()
            await watching
            pool.shutdown(wait=True)
            spec.client().close()
    await final_reading(lambda: redis_url(stack), captured)
    left = await sessions_left(redis_url(stack))
    return {
        "moves": vars(moves) | {"known": len(moves.known), "wrong": dict(moves.wrong)},
        "left_by_paths": len(left & moves.known),
        "left_unknown": len(left - moves.known),
        "minutes": args.minutes,
        "auth": args.auth,
        "faults": faults_log,
        "paths": {
            name: vars(t)
            | {"failed": dict(t.failed), "lost": dict(t.lost), "not_started": dict(t.not_started)}
            for name, t in tallies.items()
        },
        "sessions_left_open": len(left),
        "memory_mib": {"start": memory_start, "end": memory_mib(stack)},
        "captures": captured,
    }


async def sessions_left(url: str) -> set[str]:
    """The ids of the sessions still in Redis."""
    from redis.asyncio import Redis

    redis = Redis.from_url(url)
    prefix = b"codegym:session:"
    try:
        return {key[len(prefix) :].decode() async for key in redis.scan_iter(match=prefix + b"*")}
    finally:
        await redis.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=20.0, help="how long episodes are started")
    parser.add_argument("--rollouts", type=int, default=16, help="episodes in flight per path")
    parser.add_argument("--think-s", type=float, default=1.0, help="mean think time before each step")
    parser.add_argument(
        "--moves-share",
        type=float,
        default=0.5,
        help="share of the client path's episodes that fork (2 ways) or suspend and restore at a random step",
    )
    parser.add_argument("--faults", default="all", help=f"comma list of {', '.join(FAULTS)}, or all")
    parser.add_argument("--paths", default="all", help=f"comma list of {', '.join(PATHS)}, or all")
    parser.add_argument(
        "--redis",
        choices=("up", "given"),
        default="up",
        help="up: the Redis codegym up starts for itself, SIGKILLed by the redis fault; given: one of "
        "the soak's own, passed with --sessions, stopped and started again",
    )
    parser.add_argument(
        "--auth",
        action="store_true",
        help="codegym up --auth: every path plays on the trainer token up makes (the gateway's with "
        "its Bearer header)",
    )
    parser.add_argument(
        "--outage-wait-s", type=float, default=600.0, help="the trainer adapters' outage wait (their default)"
    )
    parser.add_argument(
        "--trainers-python",
        default=str(TRAINERS_PYTHON),
        help="the trainers' venv (TRL, verl); absent: their adapters' contract runs in this process",
    )
    parser.add_argument(
        "--capture",
        type=float,
        default=1.0,
        help="the runtimes' --capture: the fraction of episodes captured whole (every one by default)",
    )
    parser.add_argument(
        "--capture-bytes",
        type=int,
        default=256 * 1024,
        help="the runtimes' --capture-bytes: the bound the captures must stay within through the soak "
        "(small, so it is reached within minutes)",
    )
    parser.add_argument(
        "--memory-growth-mib",
        type=float,
        default=MEMORY_GROWTH_MIB,
        help="the PSS a server may gain from start to end (a restarted server's end against the first one's start)",
    )
    args = parser.parse_args()
    lines = [
        t for t in read_trajectories(ROOT / "codegym" / "samples" / "trajectories.jsonl") if t.get("steps")
    ]
    workdir = Path(tempfile.mkdtemp(prefix="codegym-soak-"))
    os.chmod(workdir, 0o755)
    capture = ("--capture", str(args.capture), "--capture-bytes", str(args.capture_bytes))
    with soak_stack(workdir, args.redis, args.auth, capture) as stack:
        report = asyncio.run(soak(args, stack, lines, workdir))
    access = "access tokens on (up --auth)" if report["auth"] else "no access tokens"
    print(f"soak of {report['minutes']:g} min, {access}, faults: {len(report['faults'])}")
    for entry in report["faults"]:
        print(f"  {entry}")
    print(f"{'path':<8} {'finished':>8} {'shaped':>6} {'steps':>7}  failed (marked) / lost / could not start")
    for name, tally in report["paths"].items():
        print(
            f"{name:<8} {tally['finished']:>8} {tally['shaped']:>6} {tally['steps']:>7}  "
            f"{tally['failed'] or 0} / {tally['lost'] or 0} / {tally['not_started'] or 0}"
        )
        print(f"         ran as: {tally['mode']}; trainer processes died: {tally['died']}")
        for example in tally["examples"][:5]:
            print(f"         shaped: {example}")
    moves = report["moves"]
    print(
        f"client path moves: {moves['forks']} sessions forked, {moves['suspends']} suspended and "
        f"{moves['restores']} restored; {moves['known']} sessions handed to it; wrong answers: "
        f"{sum(moves['wrong'].values())}"
    )
    for example in list(moves["wrong"])[:5]:
        print(f"         wrong: {example}")
    print(
        f"sessions left open in Redis: {report['sessions_left_open']} ({report['left_by_paths']} "
        f"handed to the client path, {report['left_unknown']} to no call it saw answered: duplicates, "
        "or other paths' sessions)"
    )
    print("PSS MiB at start -> end (workers without their session processes, counted apart):")
    start, end = report["memory_mib"]["start"], report["memory_mib"]["end"]
    for name in sorted(set(start) | set(end)):
        print(f"  {name:<18} {start.get(name, 0):8.1f} -> {end.get(name, 0):8.1f}")
    print_watch(report["captures"])
    broken = verdict(report, args.memory_growth_mib)
    for line in broken:
        print(f"FAILED: {line}")
    print("soak: " + ("FAILED" if broken else "passed"))
    sys.exit(1 if broken else 0)


def verdict(report: dict[str, Any], growth_mib: float) -> list[str]:
    """What the soak must hold: no observation shaped by a fault on any path; no episode lost to a
    trainer path (the OpenEnv path is reported only: its protocol cannot resume an episode whose
    socket a gateway restart closed past its grace); no session left open; no server growing past
    `growth_mib`; captures within their byte bound at every reading, their count true at the end."""
    broken: list[str] = report["captures"].broken()
    for name, tally in report["paths"].items():
        if tally["shaped"]:
            broken.append(f"{name}: {tally['shaped']} episodes shaped by a fault")
        if name in TRAINER_PATHS and tally["lost"]:
            broken.append(f"{name}: episodes lost {tally['lost']}")
        if tally["died"]:
            broken.append(f"{name}: {tally['died']} trainer process died")
    if report["moves"]["wrong"]:
        broken.append(f"forks or restores answered wrongly: {report['moves']['wrong']}")
    if report["sessions_left_open"]:
        broken.append(f"{report['sessions_left_open']} sessions left open in Redis")
    start, end = report["memory_mib"]["start"], report["memory_mib"]["end"]
    for name in sorted(set(start) & set(end) - {"resident sessions"}):
        if end[name] - start[name] > growth_mib:
            broken.append(f"{name} grew {end[name] - start[name]:.1f} MiB (bound {growth_mib:g})")
    return broken


if __name__ == "__main__":
    main()
