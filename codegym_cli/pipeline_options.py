"""`codegym pipeline run|status`: problems in, a verified environment library out.

    codegym pipeline run --problems codegym/samples/problems.jsonl --library lib.db --work run1 \\
        --llm-base-url http://127.0.0.1:8000/v1 --model scripted

Starts what is not given (sandbox workers, the verification service, the synthesis service with
its response cache in WORK/llm_cache.db) as child processes on loopback, runs every problem
through the stages, and prints per stage: problems in, passed, rejected by reason, LLM tokens and
time. Interrupt it at any point and run the same command again: finished stages are not redone
and LLM answers come from the cache. `codegym pipeline status --work DIR` prints the table.
"""

from __future__ import annotations

import argparse

from codegym_cli.later import later
from sandbox_worker.settings import DEFAULT_JAILS


def register(sub: argparse._SubParsersAction) -> None:
    from codegym_cli.synthesize import add_llm_arguments

    pipeline = sub.add_parser(
        "pipeline",
        help="problems in, a verified environment library out (synthesis + verification + filters)",
        description=__doc__,
    )
    pipe_sub = pipeline.add_subparsers(dest="pipeline_command", required=True, metavar="ACTION")
    run = pipe_sub.add_parser(
        "run",
        help="run (or resume) a pipeline over a problem file",
        description=__doc__,
    )
    run.add_argument(
        "--problems",
        required=True,
        help="JSONL or Parquet: question_id, question, solution[, entry_point, arg_names]",
    )
    run.add_argument("--work", required=True, help="work folder: pipeline.db (stage status), LLM cache, logs")
    run.add_argument("--library", default="", help="library to write (default WORK/library.db)")
    run.add_argument("--limit", type=int, default=0, help="only the first N problems (0 = all)")
    run.add_argument(
        "--only",
        default="",
        help="only the problems FILE names: question or env ids, one a line, or `library stats` JSON lines "
        "(e.g. the envs a run has mastered, for --hard-tests)",
    )
    run.add_argument("--parallel", type=int, default=8, help="problems in flight")
    run.add_argument("--synthesis", default="", help="synthesis service HOST:PORT (default: start one)")
    run.add_argument("--verification", default="", help="verification service HOST:PORT (default: start one)")
    run.add_argument(
        "--sandbox", default="", help="sandbox workers HOST:PORT,... for a started verification service"
    )
    run.add_argument(
        "--workers", type=int, default=2, help="sandbox workers to start when --sandbox is not given"
    )
    run.add_argument("--jails", type=int, default=DEFAULT_JAILS, help="jails per started worker")
    run.add_argument("--hard-tests", action="store_true", help="also generate hard unit tests")
    run.add_argument("--reject-unsafe", action="store_true", help="reject (not only flag) risky constructs")
    run.add_argument("--ref-time-ms", type=int, default=3000, help="time limit of one get_ref_answer()")
    run.add_argument("--ref-memory-mb", type=int, default=100, help="memory limit of one get_ref_answer()")
    run.add_argument("--max-answer-chars", type=int, default=100, help="longest accepted answer repr()")
    run.add_argument("--min-valid", type=int, default=10, help="valid tests an environment needs")
    run.add_argument(
        "--min-valid-ratio", type=float, default=0.8, help="fraction of distinct tests that must be valid"
    )
    run.add_argument("--case-time-ms", type=int, default=10_000, help="time limit of one solve() run")
    run.add_argument("--case-memory-mb", type=int, default=256, help="memory limit of one solve() run")
    run.add_argument("--max-steps", type=int, default=1024, help="step() calls one solve() run may make")
    run.add_argument("--budget-s", type=float, default=300.0, help="solvability budget per environment")
    run.add_argument(
        "--min-solve-fc-round", type=int, default=10, help="fewest oracle steps of a kept config"
    )
    run.add_argument("--max-solve-fc-round", type=int, default=256, help="most oracle steps of a kept config")
    run.add_argument("--min-tools", type=int, default=4, help="fewest distinct tools of a kept environment")
    run.add_argument(
        "--keep-shortcuts", action="store_true", help="flag shortcut environments instead of dropping them"
    )
    run.add_argument(
        "--shortcut-fraction",
        type=float,
        default=0.5,
        help="a tool answering on more than this fraction of tests is a shortcut",
    )
    run.add_argument(
        "--no-negative-controls",
        action="store_true",
        help="skip the check that Done pays no wrong answer derived from the reference answer",
    )
    run.add_argument(
        "--determinism-tests",
        type=int,
        default=5,
        help="tests the oracle replays twice in separate processes (0 = skip the determinism check)",
    )
    run.add_argument(
        "--max-guess-rate",
        type=float,
        default=0.0,
        help="reject environments a blind Done answers right more often than this (0 = only report)",
    )
    add_llm_arguments(run)
    run.set_defaults(func=later("codegym_cli.pipeline", "cmd_run"))

    status = pipe_sub.add_parser(
        "status",
        help="print the per-stage table of a work folder (works while a run is going on)",
        description="Example: codegym pipeline status --work run1 --problems",
    )
    status.add_argument("--work", required=True, help="work folder of a pipeline run")
    status.add_argument("--problems", action="store_true", help="also list where every problem ended")
    status.set_defaults(func=later("codegym_cli.pipeline", "cmd_status"))
