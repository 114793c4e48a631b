"""`codegym library episodes`: the runtime's captured episodes as JSON lines.

A line per captured episode (its summary: tenant, run, environment, task, policy version, steps,
reward, how it ended, whether the shortcut sentinel flagged it, whether every step was kept),
newest first, filtered like ListEpisodes; with `--id` the one episode, whole: its summary, task
config, first observation and every step (action, observation, reward, error). Read through the
runtime's RPCs, so it works against any runtime; a trainer's token sees its own tenant's.

Its options are in library_curriculum_options.py (`add_episodes`); this module is imported when
the command runs.
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


def _episodes_command(args: argparse.Namespace) -> int:
    from codegym_cli.library_curriculum import with_runtime

    return with_runtime("episodes", _episodes)(args)
