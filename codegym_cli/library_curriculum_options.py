"""`codegym library stats|sample|history|quarantine|label|episodes`: the runtime's record of
served episodes, and its captured episodes (`episodes`, library_episodes.py).

The runtime records every finished episode against its task configuration and its trainer's run
(`create_session(run_id=...)`); these commands read that record through its RPCs, so they work
against any runtime, local or deployed, and never open its store:

- `stats` prints it as JSON lines, a line per task configuration, then a line per environment
  (`TaskStats` / `EnvStats`, every field, with `"kind": "task"|"env"`);
- `sample` asks the runtime's sampler for N task configurations chosen for a run to learn from;
- `quarantine` lists the environments kept out of sampling, with their evidence, and `--lift`
  lets one be sampled again (nothing is ever deleted);
- `label --from-stats` writes each played task's learnability (unsolved / learnable / mastered)
  into a library, where `codegym export --learnability` and `codegym eval --learnability` filter
  by it. It is kept apart from the published easy/medium/hard `difficulty`.
"""

from __future__ import annotations

import argparse

from codegym.library.location import add_library_argument
from codegym_cli.later import later
from codegym_client.curriculum import DEFAULT_MIN_EPISODES
from codegym_client.defaults import DEFAULT_TARGET


def fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"a fraction in [0, 1], not {text}")
    return value


def count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"a count >= 0, not {text}")
    return value


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"at least 1, not {text}")
    return value


def add_runtime_arguments(p: argparse.ArgumentParser, *, prefix: bool = True) -> None:
    """Where the runtime is and how long to wait for it (and, where the command reads envs, which)."""
    p.add_argument("--target", default=DEFAULT_TARGET, metavar="HOST:PORT", help="the runtime")
    p.add_argument(
        "--connect-timeout", type=float, default=10.0, metavar="S", help="seconds to wait for the runtime"
    )
    p.add_argument("--timeout", type=float, default=60.0, metavar="S", help="deadline of one call")
    if prefix:
        p.add_argument("--env-prefix", default="", metavar="P", help="only env ids starting with this")


def add_band_arguments(p: argparse.ArgumentParser) -> None:
    """The learnable band: the pass rates between unsolved and mastered."""
    p.add_argument("--low", type=fraction, default=0.0, metavar="L", help="pass rate at or below: unsolved")
    p.add_argument("--high", type=fraction, default=1.0, metavar="H", help="pass rate at or above: mastered")
    p.add_argument(
        "--min-episodes",
        type=count,
        default=DEFAULT_MIN_EPISODES,
        metavar="M",
        help="episodes of a task before its pass rate decides",
    )


def add_stats(lib_sub: argparse._SubParsersAction) -> None:
    stats = lib_sub.add_parser(
        "stats",
        help="the runtime's record of served episodes as JSON lines: each task config, then each env",
        description="A line per task configuration (episodes, passes, pass rate all time and recent, "
        "mean steps against the oracle's, endings, failed steps by kind, the sampler's pool), then a "
        "line per environment (the same totals, quarantine and its evidence, suspected shortcuts), each "
        'with "kind": "task" or "env". Episodes ended by the infrastructure, and sessions closed before '
        "an end, are never counted.",
    )
    add_runtime_arguments(stats)
    stats.add_argument(
        "--run", default="", metavar="RUN", help="one trainer run's record (default: every run)"
    )
    stats.add_argument("--envs-only", action="store_true", help="environments only, no task lines")
    stats.add_argument("--played-only", action="store_true", help="only tasks the run has played")
    stats.set_defaults(func=later("codegym_cli.library_curriculum", "_stats_command"))


def add_sample(lib_sub: argparse._SubParsersAction) -> None:
    sample = lib_sub.add_parser(
        "sample",
        help="N task configs chosen for a run to learn from (the runtime's sampler), as JSON lines",
        description="Most come from the learnable band (the run's pass rate strictly between --low and "
        "--high), a share (--explore) from tasks the run has not played; mastered and unsolved tasks and "
        "quarantined environments are left out, and no environment gives more than --per-env-cap. The "
        "same seed and record give the same choice. The pools' sizes go to stderr.",
    )
    add_runtime_arguments(sample)
    sample.add_argument("--run", required=True, metavar="RUN", help="the trainer run the choice is for")
    sample.add_argument("-n", type=positive, required=True, metavar="N", help="how many task configs")
    sample.add_argument(
        "--seed", type=count, default=0, metavar="S", help="the same seed gives the same choice"
    )
    add_band_arguments(sample)
    sample.add_argument(
        "--explore",
        type=fraction,
        default=None,
        metavar="X",
        help="share of unplayed tasks (runtime default: 0.05)",
    )
    sample.add_argument(
        "--per-env-cap",
        type=count,
        default=0,
        metavar="C",
        help="most tasks of one env (0: the runtime's default)",
    )
    sample.set_defaults(func=later("codegym_cli.library_curriculum", "_sample_command"))


def add_history(lib_sub: argparse._SubParsersAction) -> None:
    history = lib_sub.add_parser(
        "history",
        help="a run's pools, groups and pool moves at each policy version it reached, as JSON lines",
        description="A line per policy version the run reached (CreateSession's policy_version), oldest "
        "first: the run's played tasks then, and how many of them were learnable (a pass rate strictly "
        "between 0 and 1 over their last 16 episodes, or fewer than 4 episodes), mastered and unsolved, "
        "as they stood after the last episodes recorded at that version; its (task, policy version) "
        "groups (groups, multi_episode_groups: of 2 episodes or more, zero_variance_groups: of those, "
        "every reward equal), open ones included; and its tasks that moved pools during that version "
        "(moves: from_pool, to_pool, tasks). Bounded: the runtime keeps the last 1,000 versions of each "
        "of its last 256 runs. An unknown run is an error.",
    )
    add_runtime_arguments(history, prefix=False)
    history.add_argument("--run", default="", metavar="RUN", help="the trainer run (default: every run)")
    history.set_defaults(func=later("codegym_cli.library_curriculum", "_history_command"))


def add_quarantine(lib_sub: argparse._SubParsersAction) -> None:
    quarantine = lib_sub.add_parser(
        "quarantine",
        help="the environments kept out of sampling, with their evidence (JSON lines); --lift lets one back",
        description="An environment whose steps fail (environment errors, time-outs) above the "
        "runtime's rate is quarantined: no longer sampled, still served. Nothing is deleted.",
    )
    add_runtime_arguments(quarantine)
    quarantine.add_argument("--lift", default="", metavar="ENV_ID", help="lift this environment's quarantine")
    quarantine.set_defaults(func=later("codegym_cli.library_curriculum", "_quarantine_command"))


def add_label(lib_sub: argparse._SubParsersAction) -> None:
    label = lib_sub.add_parser(
        "label",
        help="write each played task's learnability (unsolved, learnable, mastered) into a library",
        description="From the runtime's record of a run: a task whose recent pass rate (over the last "
        "episodes the runtime keeps, as the sampler's pools) is at most --low is unsolved, at least "
        "--high mastered, learnable between; a task with fewer than --min-episodes recent episodes "
        "keeps its label as it was. Tasks are matched by env id and config. "
        "`codegym export --learnability` and `codegym eval --learnability` filter by the label; the "
        "published easy/medium/hard difficulty is another column, untouched.",
    )
    label.add_argument(
        "--from-stats", action="store_true", required=True, help="label from the runtime's record (--target)"
    )
    add_runtime_arguments(label)
    label.add_argument(
        "--run", default="", metavar="RUN", help="one trainer run's record (default: every run)"
    )
    add_library_argument(label, "library to write the labels into")
    add_band_arguments(label)
    label.set_defaults(func=later("codegym_cli.library_curriculum", "_label_command"))


def add_episodes(lib_sub: argparse._SubParsersAction) -> None:
    episodes = lib_sub.add_parser(
        "episodes",
        help="the runtime's captured episodes as JSON lines (newest first); --id prints one whole",
        description="Captured episodes: a sampled fraction of all (`serve runtime --capture RATE`) "
        "and every one the shortcut sentinel flags. A trainer's token sees its own tenant's.",
    )
    add_runtime_arguments(episodes)
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
    episodes.add_argument("--limit", type=count, default=0, metavar="N", help="at most N lines (0: all)")
    episodes.add_argument("--id", default="", metavar="ID", help="one episode, whole, with its steps")
    episodes.set_defaults(func=later("codegym_cli.library_episodes", "_episodes_command"))


def add_parsers(lib_sub: argparse._SubParsersAction) -> None:
    add_stats(lib_sub)
    add_sample(lib_sub)
    add_history(lib_sub)
    add_quarantine(lib_sub)
    add_label(lib_sub)
    add_episodes(lib_sub)
