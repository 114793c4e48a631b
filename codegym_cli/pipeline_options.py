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

from codegym.server.settings import add_arguments
from codegym_cli.later import later
from codegym_jobs.pipeline.settings import PipelineSettings
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
    run.add_argument("--synthesis", default="", help="synthesis service HOST:PORT (default: start one)")
    run.add_argument("--verification", default="", help="verification service HOST:PORT (default: start one)")
    run.add_argument(
        "--sandbox", default="", help="sandbox workers HOST:PORT,... for a started verification service"
    )
    run.add_argument(
        "--workers", type=int, default=2, help="sandbox workers to start when --sandbox is not given"
    )
    run.add_argument("--jails", type=int, default=DEFAULT_JAILS, help="jails per started worker")
    add_arguments(PipelineSettings, run)
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
