"""`codegym library replay`: CodeGym's published reference trajectories as a fidelity check.

CodeGym's published task rows carry, in `extra_info`, the oracle's actions (`std_traj`) and the
observations its environment answered (`obs_traj`), as Python-literal strings; `codegym library
import` keeps them verbatim in the library's `trajectories` table. This command plays each task's
actions in order through sandbox workers (create, then one step per action, each step from the state
the last one returned) with the code the task was recorded with (its `source_sha` variant when it
has one, else its environment's), and compares every observation with the recorded one as the
other fidelity checks do (`codegym demo`, the soak): exact string equality.

Reading the recordings. Their encoding is known only from what consumes them, so reading is
liberal where that cannot turn into a false "different", and anything else is *unreadable*
(reported apart, never as a difference):

- Each field is a Python literal (`ast.literal_eval`), else JSON text, holding a list (or the
  text of one, once: a field quoted twice on its way).
- An action is the JSON text of an action, an action object, or a list of exactly one of either;
  an action object is read by the one action rule the runtime and the clients apply
  (`codegym_client.actions`: `parameters` or `arguments`), and the environment is sent its
  canonical `{"name": ..., "parameters": {...}}` text, as the runtime would send it. Action text
  that is not JSON (a Python-literal dict, say) is unreadable: the environment could never have
  read it as recorded.
- An observation is read as the sandbox reads what `env.step()` returned: a pair (a tuple of two,
  `(True, text)`) stands for its second item, and a value that is not a string for its `str()`.
- `obs_traj` holds one observation per action, or one more: then its first entry is the
  observation of the reset (compared with what the create answered, reported as step 0) and the
  rest follow the actions (steps 1...). Any other length, or no action at all, is unreadable.

Outcomes per task: *identical*; *different* (the first differing step, the action, expected and
got, cut around the first differing character); *failed*, with its fault kept apart: the
environment's own (it raised, timed out, ran out of memory: the worker already ran anything that
may have come from outside once more), the infrastructure's (no worker answered, after the
dispatcher's retries and this command's own), or the library's (the code the task was recorded with
is not in it); *unreadable*. An infrastructure fault is never "different".

Resuming: every task with a verdict is appended (one JSON line, flushed) to a state file; a run
given the same state skips tasks whose line matches the task as it stands now (environment,
config, code and both recordings, by fingerprint) and reports the combined totals. Tasks that
failed for the infrastructure get no line, so the next run tries them again.
"""

from __future__ import annotations

import argparse

from codegym.library.location import add_library_argument
from codegym_cli.later import later
from services.runtime.config import RuntimeConfig


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_parser(library_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    replay = library_subparsers.add_parser(
        "replay",
        help="play the published reference trajectories (std_traj, obs_traj) through sandbox workers "
        "and compare every observation",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
    )
    add_library_argument(replay)
    replay.add_argument(
        "--sandbox", metavar="HOST:PORT[,HOST:PORT...]", required=True, help="sandbox workers to replay on"
    )
    replay.add_argument(
        "--sample", metavar="N", type=positive, help="replay N tasks drawn at random, not all"
    )
    replay.add_argument(
        "--seed", metavar="S", type=int, default=0, help="the same seed draws the same sample"
    )
    replay.add_argument("--prefix", metavar="P", default="", help="only env ids starting with this")
    replay.add_argument(
        "--state",
        metavar="FILE",
        help="verdicts of finished tasks, read to resume and appended to; when not given, OUT.state "
        "beside --out, else LIBRARY.replay-state.jsonl (delete it to replay everything again)",
    )
    replay.add_argument(
        "--out", metavar="FILE.jsonl", help="one JSON line per task (outcome, step, expected, got)"
    )
    replay.add_argument("--concurrency", metavar="C", type=positive, default=4, help="tasks in flight")
    replay.add_argument(
        "--step-timeout-ms",
        metavar="MS",
        type=positive,
        default=RuntimeConfig.step_timeout_ms,
        help="wall-clock limit of one step, the runtime's default (a create gets twice this)",
    )
    replay.add_argument(
        "--connect-timeout", metavar="S", type=float, default=10.0, help="seconds to wait for the workers"
    )
    replay.set_defaults(func=later("codegym_cli.library_replay", "run"))
    return replay
