"""`codegym demo`: play the library through a running runtime, as a trainer would.

Two agents: the oracle (replays each task's recorded `solve()` trajectory and checks every
observation against the recording) and a random agent (random tools with random arguments built
from the tools' JSON schemas). Prints one row per environment and the overall throughput.
"""

from __future__ import annotations

import argparse

from codegym.samples import TRAJECTORIES
from codegym_cli.later import later
from codegym_client.defaults import DEFAULT_TARGET


def register(sub: argparse._SubParsersAction) -> None:
    demo = sub.add_parser(
        "demo",
        help="play every sample task through a running runtime (oracle replays + random agent)",
    )
    demo.add_argument("--target", default=DEFAULT_TARGET, help="runtime address")
    demo.add_argument(
        "--trajectories",
        default=str(TRAJECTORIES),
        help="oracle trajectories (write them with 'codegym library oracle')",
    )
    demo.add_argument("--random-episodes", type=int, default=3, help="random-agent episodes per environment")
    demo.add_argument("--random-steps", type=int, default=20, help="step cap of a random episode")
    demo.add_argument("--concurrency", type=int, default=16, help="episodes in flight")
    demo.add_argument("--seed", type=int, default=0, help="seed of the random agent")
    demo.add_argument("--connect-timeout", type=float, default=2.0, help="seconds to wait for the runtime")
    demo.set_defaults(func=later("codegym_cli.demo", "cmd_demo"))
