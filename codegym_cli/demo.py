"""`codegym demo`: play the library through a running runtime, as a trainer would.

Two agents: the oracle (replays each task's recorded `solve()` trajectory and checks every
observation against the recording) and a random agent (random tools with random arguments built
from the tools' JSON schemas). Prints one row per environment and the overall throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from codegym_cli.access import client_access
from codegym_cli.progress import stderr_progress
from codegym_client import AsyncRuntimeClient, CodeGymError
from codegym_jobs.oracle import read_trajectories


@dataclass
class PlayedEpisode:
    env_id: str
    agent: str
    steps: int = 0
    reward: float = 0.0
    seconds: float = 0.0
    matched: bool = True
    errors: int = 0
    failure: str = ""


@dataclass
class EnvRow:
    oracle: list[PlayedEpisode] = field(default_factory=list)
    random: list[PlayedEpisode] = field(default_factory=list)


async def play_oracle(client: AsyncRuntimeClient, line: dict[str, Any]) -> PlayedEpisode:
    episode = PlayedEpisode(line["env_id"], "oracle")
    try:
        created = await client.create_session(env_id=line["env_id"], config=line["config"])
        episode.matched = created.observation == line["first"]
        start = time.perf_counter()
        for action, expected in line["steps"]:
            response = await client.step(created.session_id, action)
            episode.steps += 1
            episode.matched &= response.observation == expected
            episode.reward = response.reward
            if response.HasField("error"):
                episode.errors += 1
        episode.seconds = time.perf_counter() - start
        await client.close_session(created.session_id)
    except grpc.RpcError as exc:
        episode.failure = f"{exc.code().name}: {exc.details()}"
    return episode


def random_value(schema: dict[str, Any], rng: random.Random) -> Any:
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = rng.choice(kind)
    if kind == "integer":
        return rng.randint(0, 5)
    if kind == "number":
        return round(rng.uniform(-5, 5), 2)
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "string":
        return rng.choice(["a", "b", "0", "1", "abc"])
    if kind == "array":
        item = schema.get("items") or {"type": "integer"}
        return [random_value(item, rng) for _ in range(rng.randint(0, 3))]
    if kind == "object":
        return {}
    return rng.randint(0, 5)


async def play_random(
    client: AsyncRuntimeClient,
    env_id: str,
    config_json: str,
    tools: list[dict[str, Any]],
    seed: int,
    max_steps: int,
) -> PlayedEpisode:
    rng = random.Random(seed)
    episode = PlayedEpisode(env_id, "random")
    try:
        created = await client.create_session(env_id=env_id, config=config_json, max_steps=max_steps)
        start = time.perf_counter()
        while True:
            tool = rng.choice(tools)["function"]
            properties = tool["parameters"].get("properties", {})
            action = {
                "name": tool["name"],
                "parameters": {k: random_value(v, rng) for k, v in properties.items()},
            }
            response = await client.step(created.session_id, action)
            episode.steps += 1
            episode.reward = response.reward
            episode.errors += response.HasField("error")
            if response.done or episode.steps >= max_steps * 2:
                break
        episode.seconds = time.perf_counter() - start
        await client.close_session(created.session_id)
    except grpc.RpcError as exc:
        episode.failure = f"{exc.code().name}: {exc.details()}"
    return episode


async def run_demo(args: argparse.Namespace) -> tuple[dict[str, EnvRow], float]:
    rows: dict[str, EnvRow] = defaultdict(EnvRow)
    limit = asyncio.Semaphore(args.concurrency)
    async with AsyncRuntimeClient(args.target, access=client_access(args)) as client:
        await client.wait_ready(args.connect_timeout)
        envs = {e.env_id: await client.get_env(e.env_id) for e in await client.list_envs()}
        trajectories = []
        if Path(args.trajectories).exists():
            trajectories = [
                t for t in read_trajectories(args.trajectories) if t["env_id"] in envs and "steps" in t
            ]
        jobs: list[Any] = []
        # Progress on stderr (episodes done, steps/s), so the table on stdout stays clean.
        progress = stderr_progress()
        job = progress.add_task("episodes", total=None)
        done = [0, 0]
        start = time.perf_counter()

        async def bounded(coro: Any) -> PlayedEpisode:
            async with limit:
                result: PlayedEpisode = await coro
            done[0] += 1
            done[1] += result.steps
            rate = done[1] / max(1e-9, time.perf_counter() - start)
            progress.update(job, advance=1, description=f"episodes ({rate:.0f} steps/s)")
            return result

        for line in trajectories:
            jobs.append(bounded(play_oracle(client, line)))
        rng = random.Random(args.seed)
        for env_id, env in envs.items():
            tools = [json.loads(t.json_schema) for t in env.tools]
            configs = [t.config_json for t in env.tasks] or ["{}"]
            for i in range(args.random_episodes):
                seed = rng.randrange(1 << 30)
                jobs.append(
                    bounded(
                        play_random(client, env_id, configs[i % len(configs)], tools, seed, args.random_steps)
                    )
                )
        start = time.perf_counter()
        progress.update(job, total=len(jobs))
        with progress:
            episodes = await asyncio.gather(*jobs)
        wall = time.perf_counter() - start
    for episode in episodes:
        row = rows[episode.env_id]
        (row.oracle if episode.agent == "oracle" else row.random).append(episode)
    return rows, wall


def report(rows: dict[str, EnvRow], wall: float, console: Console) -> int:
    table = Table(title="codegym demo: oracle replays and a random agent through the runtime")
    for column in (
        "environment",
        "oracle eps",
        "steps",
        "reward",
        "obs match",
        "ms/step",
        "random eps",
        "random reward",
    ):
        table.add_column(column, justify="left" if column == "environment" else "right", no_wrap=True)
    total_steps = 0
    problems: list[str] = []
    for env_id in sorted(rows):
        row = rows[env_id]
        oracle, rand = row.oracle, row.random
        steps = sum(e.steps for e in oracle + rand)
        total_steps += steps
        seconds = sum(e.seconds for e in oracle + rand)
        matched = sum(e.matched and not e.failure for e in oracle)
        solved = sum(e.reward == 1.0 for e in oracle)
        for e in oracle + rand:
            if e.failure:
                problems.append(f"{env_id} ({e.agent}): {e.failure}")
        for e in oracle:
            if not e.failure and (e.reward != 1.0 or not e.matched):
                problems.append(f"{env_id} (oracle): reward {e.reward}, observations match {e.matched}")
        table.add_row(
            env_id,
            str(len(oracle)),
            str(sum(e.steps for e in oracle)),
            f"{solved}/{len(oracle)}" if oracle else "-",
            f"{matched}/{len(oracle)}" if oracle else "-",
            f"{1000 * seconds / steps:.2f}" if steps else "-",
            str(len(rand)),
            f"{statistics.fmean(e.reward for e in rand):.2f}" if rand else "-",
        )
    console.print(table)
    episodes = sum(len(r.oracle) + len(r.random) for r in rows.values())
    console.print(
        f"{episodes} episodes, {total_steps} steps in {wall:.2f} s: "
        f"{total_steps / wall if wall else 0:.0f} steps/s across the sessions in flight"
    )
    for problem in problems:
        console.print(f"[red]problem[/red] {problem}")
    return 1 if problems else 0


def failure_line(target: str, exc: BaseException) -> str:
    """One line on why the runtime could not be used (the connection's cause when it never connected)."""
    if isinstance(exc, CodeGymError) and exc.method == "wait_ready":
        return f"codegym demo: {exc.details()}"  # "cannot reach HOST:PORT: connection refused (...)"
    if isinstance(exc, grpc.RpcError):
        code, details = getattr(exc, "code", None), getattr(exc, "details", None)
        reason = f"{code().name}: {details()}" if callable(code) and callable(details) else str(exc)
    else:
        reason = str(exc) or type(exc).__name__
    return f"codegym demo: cannot use the runtime at {target}: {reason}"


def cmd_demo(args: argparse.Namespace) -> int:
    console = Console(width=None if Console().is_terminal else 140)
    try:
        rows, wall = asyncio.run(run_demo(args))
    except (TimeoutError, grpc.RpcError) as exc:
        errors = Console(stderr=True, width=console.width)
        line = escape(failure_line(args.target, exc))
        errors.print(f"[red]{line}[/red] (start one with: codegym up)", soft_wrap=True)
        return 2
    return report(rows, wall, console)
