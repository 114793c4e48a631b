"""`codegym library stats|sample|history|quarantine|label`: the runtime's record of served episodes.

The runtime records every finished episode against its task configuration and its trainer's run
(`create_session(run_id=...)`); these commands read that record through its RPCs, so they work
against any runtime, local or deployed, and never open its store:

- `stats` prints it as JSON lines, a line per task configuration, then a line per environment
  (`TaskStats` / `EnvStats`, every field, with `"kind": "task"|"env"`);
- `sample` asks the runtime's sampler for N task configurations chosen for a run to learn from;
- `quarantine` lists the environments kept out of sampling, with their evidence, and `--lift`
  lets one be sampled again (nothing is ever deleted);
- `history` prints a run's played tasks by pool at each policy version it reached, with the
  version's (task, policy version) groups (zero-variance ones among them) and the tasks that moved
  pools during it (the runtime keeps the last 1,000 versions of each of its last 256 runs), as
  JSON lines;
- `label --from-stats` writes each played task's learnability (unsolved / learnable / mastered)
  into a library, where `codegym export --learnability` and `codegym eval --learnability` filter
  by it. It is kept apart from the published easy/medium/hard `difficulty`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message

from codegym.contract import parse_ability
from codegym.contract.errors import EnvStringError
from codegym.library.records import LEARNABILITY
from codegym.library.store import Library, canonical_config
from codegym_cli.access import client_access
from codegym_client import CodeGymError, RuntimeClient
from codegym_client.abilities import ABILITY_FORMAT
from codegym_client.api.runtime.v1 import runtime_service_pb2 as rt
from codegym_client.curriculum import Band


def message_dict(message: Message) -> dict[str, Any]:
    """Every field of `message` by its proto name, in the proto's order, defaults included (a 0
    pass rate is a figure, not a missing one); an unset optional field (no prior) stays out."""
    data = json_format.MessageToDict(
        message,
        always_print_fields_with_no_presence=True,
        preserving_proto_field_name=True,
        unquote_int64_if_possible=True,
    )
    return {f.name: data[f.name] for f in message.DESCRIPTOR.fields if f.name in data}


def entry_dict(entry: rt.StatsResponse) -> dict[str, Any]:
    """One `Stats` entry as a JSON object: `kind` ("task" or "env"), then its fields."""
    kind = entry.WhichOneof("entry") or ""
    return {"kind": kind, **(message_dict(getattr(entry, kind)) if kind else {})}


def run_name(run: str) -> str:
    return f"run {run!r}" if run else "any run"


def with_runtime(
    command: str, body: Callable[[RuntimeClient, argparse.Namespace], int]
) -> Callable[..., int]:
    """`body(client, args)` with a client of `--target`, connected first; a runtime that cannot be
    reached or refuses is one line on stderr and exit 1, never a traceback."""

    def run(args: argparse.Namespace) -> int:
        with RuntimeClient(args.target, timeout_s=args.timeout, access=client_access(args)) as client:
            try:
                client.wait_ready(args.connect_timeout)
                return body(client, args)
            except CodeGymError as exc:
                print(f"codegym library {command}: {failure(args.target, exc)}", file=sys.stderr)
                return 1

    return run


def failure(target: str, exc: CodeGymError) -> str:
    if exc.method == "wait_ready":
        return str(exc.details())  # "cannot reach HOST:PORT: connection refused (...)"
    code = exc.code()
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return f"the runtime at {target} keeps no record of episodes (an older release): {exc.details()}"
    return f"the runtime at {target} refused {exc.method}: {code.name}: {exc.details()}"


def _stats(client: RuntimeClient, args: argparse.Namespace) -> int:
    kinds: Counter[str] = Counter()
    played = 0
    for entry in client.stats(
        args.run, env_prefix=args.env_prefix, envs_only=args.envs_only, played_only=args.played_only
    ):
        line = entry_dict(entry)
        kinds[line["kind"]] += 1
        # A run is known by its played tasks (by its environments when there are no task lines).
        played += line.get("episodes", 0) > 0 and (line["kind"] == "task" or args.envs_only)
        print(json.dumps(line, ensure_ascii=False), flush=True)
    if not played:
        print(
            f"codegym library stats: no finished episode of {run_name(args.run)} is recorded"
            f"{f' under {args.env_prefix!r}' if args.env_prefix else ''} (a run is named by the trainer's"
            " create_session(run_id=...))",
            file=sys.stderr,
        )
    else:
        print(f"{kinds['task']} tasks ({played} played), {kinds['env']} environments", file=sys.stderr)
    return 0


def band_error(command: str, args: argparse.Namespace) -> str:
    """What is wrong with `--low`/`--high` ("" = nothing), told before the runtime is asked."""
    if args.low < args.high:
        return ""
    return f"codegym library {command}: --low {args.low} must be below --high {args.high}"


def _sample(client: RuntimeClient, args: argparse.Namespace) -> int:
    response = client.sample_tasks(
        args.run,
        args.n,
        seed=args.seed,
        low=args.low,
        high=args.high,
        explore=args.explore,
        per_env_cap=args.per_env_cap,
        min_episodes=args.min_episodes,
        env_prefix=args.env_prefix,
    )
    for task in response.tasks:
        print(json.dumps(message_dict(task), ensure_ascii=False))
    pools = ", ".join(f"{name} {size}" for name, size in sorted(response.pools.items()))
    print(
        f"{len(response.tasks)} of {args.n} chosen for {run_name(args.run)}; pools: {pools or 'none'}",
        file=sys.stderr,
    )
    if not response.tasks:
        print("codegym library sample: no eligible task (an empty library or prefix?)", file=sys.stderr)
        return 1
    return 0


def _history(client: RuntimeClient, args: argparse.Namespace) -> int:
    points = client.run_history(args.run)
    for point in points:
        print(json.dumps(message_dict(point), ensure_ascii=False))
    if not points:
        print(
            f"codegym library history: {run_name(args.run)} has no policy version recorded yet",
            file=sys.stderr,
        )
    else:
        print(f"{len(points)} policy versions of {run_name(args.run)}", file=sys.stderr)
    return 0


def _quarantine(client: RuntimeClient, args: argparse.Namespace) -> int:
    if args.lift:
        if client.lift_quarantine(args.lift):
            print(f"lifted the quarantine of {args.lift}: it is sampled again")
            return 0
        print(f"codegym library quarantine: {args.lift} is not quarantined: nothing lifted", file=sys.stderr)
        return 1
    quarantined = 0
    for entry in client.stats(env_prefix=args.env_prefix, envs_only=True):
        if entry.WhichOneof("entry") == "env" and entry.env.quarantined:
            quarantined += 1
            print(json.dumps(entry_dict(entry), ensure_ascii=False), flush=True)
    print(f"{quarantined or 'no'} environment{'' if quarantined == 1 else 's'} quarantined", file=sys.stderr)
    return 0


def task_labels(
    entries: Iterable[rt.StatsResponse], low: float, high: float, min_episodes: int
) -> tuple[list[tuple[str, str, str]], Counter[str]]:
    """(env_id, canonical config, label) of each played task that earns one, and what the rest
    were: "too_few" (fewer than `min_episodes` episodes), "unreadable" (an ability not parsed).
    The pass rate is the recent one (the task's last 32 episodes, which the runtime keeps; its
    sampler decides over the last 16 of them): a label says what the task is for the policy now,
    not at the run's start."""
    labels: list[tuple[str, str, str]] = []
    left: Counter[str] = Counter()
    for entry in entries:
        if entry.WhichOneof("entry") != "task" or not entry.task.episodes:
            continue
        task = entry.task
        label = Band(low, high, min_episodes).label(task.recent_pass_rate, task.recent_episodes)
        if not label:
            left["too_few"] += 1
            continue
        try:
            ability = parse_ability(task.ability)
        except EnvStringError:
            left["unreadable"] += 1
            continue
        labels.append((ability.env_id, canonical_config(ability.config), label))
    return labels, left


def _label(client: RuntimeClient, args: argparse.Namespace) -> int:
    entries = client.stats(args.run, env_prefix=args.env_prefix, played_only=True)
    labels, left = task_labels(entries, args.low, args.high, args.min_episodes)
    played = len(labels) + sum(left.values())
    if not played:
        print(
            f"codegym library label: no finished episode of {run_name(args.run)} is recorded: nothing to label",
            file=sys.stderr,
        )
        return 1
    written: Counter[str] = Counter()
    with Library(args.library) as library:
        for label in LEARNABILITY:
            written[label] = library.set_learnability(row for row in labels if row[2] == label)
    total = sum(written.values())
    counts = ", ".join(f"{label} {written[label]}" for label in LEARNABILITY)
    print(f"labelled {total} tasks in {args.library} from {run_name(args.run)}: {counts}")
    if left["too_few"]:
        print(
            f"{left['too_few']} played tasks have fewer than {args.min_episodes} episodes: labels left as they were",
            file=sys.stderr,
        )
    if left["unreadable"]:
        print(
            f"{left['unreadable']} tasks have an ability string that is not {ABILITY_FORMAT}",
            file=sys.stderr,
        )
    if len(labels) > total:
        print(
            f"{len(labels) - total} of the tasks to label are not in {args.library} (is it the library the"
            " runtime serves?)",
            file=sys.stderr,
        )
    return 0 if total or not labels else 1


def _label_command(args: argparse.Namespace) -> int:
    if not Path(args.library).is_file():
        print(f"codegym library label: no library at {args.library}", file=sys.stderr)
        return 2
    if error := band_error("label", args):
        print(error, file=sys.stderr)
        return 2
    return with_runtime("label", _label)(args)


def _stats_command(args: argparse.Namespace) -> int:
    return with_runtime("stats", _stats)(args)


def _history_command(args: argparse.Namespace) -> int:
    return with_runtime("history", _history)(args)


def _quarantine_command(args: argparse.Namespace) -> int:
    return with_runtime("quarantine", _quarantine)(args)


def _sample_command(args: argparse.Namespace) -> int:
    if error := band_error("sample", args):
        print(error, file=sys.stderr)
        return 2
    return with_runtime("sample", _sample)(args)
