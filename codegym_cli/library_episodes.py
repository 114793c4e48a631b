"""`codegym library episodes`: the runtime's captured episodes as JSON lines.

A line per captured episode (its summary: tenant, run, environment, task, policy version, steps,
reward, how it ended, whether the shortcut sentinel flagged it, whether every step was kept),
newest first, filtered like ListEpisodes; with `--id` the one episode, whole: its summary, task
config, first observation and every step (action, observation, reward, error). Read through the
runtime's RPCs, so it works against any runtime; a trainer's token sees its own tenant's.

Heavy imports (the client, protobuf) happen inside the command, keeping `codegym --help` quick.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def _episodes(client: Any, args: argparse.Namespace) -> int:
    from codegym_cli.library_curriculum import message_dict

    if args.id:
        episode = client.get_episode(args.id)
        line = {
            **message_dict(episode.summary),
            "config_json": episode.config_json,
            "first_observation": episode.first_observation,
            "steps": [message_dict(step) for step in episode.steps],
        }
        print(json.dumps(line, ensure_ascii=False), flush=True)
        return 0
    filters: dict[str, Any] = {
        "run_id": args.run,
        "env_id": args.env,
        "flagged_only": args.flagged,
        "errors_only": args.errors,
    }
    if args.rewarded is not None:
        filters["rewarded"] = args.rewarded
    shown = 0
    for summary in client.list_episodes(**filters):
        if not summary.env_id.startswith(args.env_prefix):
            continue
        print(json.dumps(message_dict(summary), ensure_ascii=False), flush=True)
        shown += 1
        if args.limit and shown >= args.limit:
            break
    print(f"{shown or 'no'} captured episode{'' if shown == 1 else 's'}", file=sys.stderr)
    return 0


def _command(args: argparse.Namespace) -> int:
    from codegym_cli.library_curriculum import with_runtime

    run: int = with_runtime("episodes", _episodes)(args)
    return run


def add_parser(lib_sub: argparse._SubParsersAction, runtime: Any) -> None:
    """`runtime(parser)` adds the options every runtime command shares (--target, timeouts)."""
    episodes = lib_sub.add_parser(
        "episodes",
        help="the runtime's captured episodes as JSON lines (newest first); --id prints one whole",
        description="Captured episodes: a sampled fraction of all (`serve runtime --capture RATE`) "
        "and every one the shortcut sentinel flags. A trainer's token sees its own tenant's.",
    )
    runtime(episodes)
    episodes.add_argument("--run", default="", metavar="RUN", help="only this run's")
    episodes.add_argument("--env", default="", metavar="ENV_ID", help="only this environment's")
    rewarded = episodes.add_mutually_exclusive_group()
    rewarded.add_argument(
        "--rewarded",
        dest="rewarded",
        action="store_const",
        const=True,
        default=None,
        help="only rewarded ones",
    )
    rewarded.add_argument(
        "--unrewarded", dest="rewarded", action="store_const", const=False, help="only unrewarded ones"
    )
    episodes.add_argument("--flagged", action="store_true", help="only those the shortcut sentinel flagged")
    episodes.add_argument("--errors", action="store_true", help="only those that ended by an error")
    episodes.add_argument("--limit", type=int, default=0, metavar="N", help="at most N lines (0: all)")
    episodes.add_argument("--id", default="", metavar="ID", help="one episode, whole, with its steps")
    episodes.set_defaults(func=_command)
