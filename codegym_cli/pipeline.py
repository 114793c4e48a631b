"""What `codegym pipeline` does; its options and description are in pipeline_options.py."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from codegym.library.store import Library
from codegym.procs import ServerProcess, codegym_command
from codegym.server.grpcutil import wait_serving
from codegym.server.settings import from_args
from codegym.synthesis.v1 import synthesis_service_pb2 as sy
from codegym.verification.v1 import verification_service_pb2 as vf
from codegym_cli.access import client_access
from codegym_client.channels import aio_channel
from codegym_jobs.pipeline.runner import LLM_STAGES, STAGES, Pipeline, PipelineConfig
from codegym_jobs.pipeline.settings import PipelineSettings
from codegym_jobs.pipeline.state import PipelineState, StageOutcome
from services.synthesis.problems import load_problems
from services.synthesis.settings import LLMSettings

SYNTHESIS = sy.DESCRIPTOR.services_by_name["SynthesisService"].full_name
VERIFICATION = vf.DESCRIPTOR.services_by_name["VerificationService"].full_name
SHORT = {
    "environment": "env",
    "check": "check",
    "unit_tests": "tests",
    "hard_tests": "hard",
    "validate": "valid",
    "solve_functions": "solve",
    "solvability": "solvable",
    "negative_controls": "negctl",
    "determinism": "determ",
    "guessability": "guess",
    "filters": "filters",
    "library": "library",
}


@contextmanager
def local_services(args: argparse.Namespace, work: Path) -> Iterator[tuple[str, str]]:
    """(synthesis, verification) addresses: the ones given, or servers started here until exit.

    Started ones are stopped on the way out, and die with this process however it ends (they are
    forked from the main thread with `PR_SET_PDEATHSIG`, see `codegym.procs`).
    """
    from codegym.server.settings import from_args, secrets_env, to_argv
    from sandbox_worker.settings import SandboxSettings
    from services.synthesis.settings import LLMSettings, Stages, SynthesisSettings
    from services.verification.settings import VerificationSettings

    with ExitStack() as stack:
        started: list[ServerProcess] = []

        def start(name: str, command: list[str], settings: Any) -> str:
            """`codegym serve ...` on any free loopback port, its settings as argv, its secrets (the
            LLM's API key) in its own environment."""
            settings = replace(settings, host="127.0.0.1", port=0, log_level="WARNING")
            argv = codegym_command([*command, *to_argv(settings)])
            env = {**os.environ, **secrets_env(settings)}
            child = ServerProcess(argv, name=name, stderr=None, keep=200, stacks=True, env=env)
            started.append(child)
            stack.callback(child.stop)
            return child.address

        verification = args.verification
        if not verification:
            sandbox = args.sandbox
            if not sandbox:
                worker = SandboxSettings(jails=args.jails)
                workers = [
                    start(f"sandbox worker {i + 1}", ["serve", "sandbox"], worker)
                    for i in range(args.workers)
                ]
                sandbox = ",".join(workers)
            verification = start(
                "verification", ["serve", "verification"], VerificationSettings(sandbox=sandbox)
            )
        synthesis = args.synthesis
        if not synthesis:
            settings = SynthesisSettings(
                out=str(work / "synthesis"),
                cache=str(work / "llm_cache.db"),
                llm=from_args(LLMSettings, args),
                stages=from_args(Stages, args),
            )
            synthesis = start("synthesis", ["serve", "synthesis"], settings)
        for child in started:
            wait_serving(child.address, access=client_access(args))
        yield synthesis, verification


def config_from(args: argparse.Namespace) -> PipelineConfig:
    return PipelineConfig.of(from_args(PipelineSettings, args), args.model)


def summary_table(state: PipelineState, stages: tuple[str, ...], title: str) -> Table:
    rows, _ = state.summary(stages)
    table = Table(
        title=title,
        caption="time s: summed over problems (several run at once); tokens and requests: this work folder's",
    )
    for column in (
        "stage",
        "in",
        "passed",
        "rejected",
        "rejected by reason",
        "LLM tokens in/out",
        "requests (cached)",
        "time s",
    ):
        table.add_column(column, justify="left" if column in ("stage", "rejected by reason") else "right")
    for row in rows:
        reasons = ", ".join(f"{k} ×{v}" for k, v in row.reasons.most_common(4)) or "-"
        llm = row.stage in LLM_STAGES
        table.add_row(
            row.stage,
            str(row.entered),
            str(row.passed),
            str(row.rejected) + (f" (+{row.errors} errors)" if row.errors else ""),
            reasons,
            f"{row.prompt_tokens}/{row.completion_tokens}" if llm else "-",
            f"{row.llm_requests} ({row.cache_hits})" if llm else "-",
            f"{row.wall_s:.1f}",
        )
    return table


def print_summary(state: PipelineState, stages: tuple[str, ...], title: str) -> None:
    console = Console(width=None if Console().is_terminal else 180)
    console.print(summary_table(state, stages, title))


def named_problems(path: Path) -> set[str]:
    """The problems a file names: a question id or an env id (`{question_id}__{Env}`) per line, or
    JSON lines with an `env_id` (what `codegym library stats --envs-only` prints), so the stages
    can be pointed at, say, the environments a run has mastered."""
    names: set[str] = set()
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line:
            continue
        if line.startswith("{"):
            row = json.loads(line)
            line = str(row.get("env_id") or row.get("question_id") or "")
        names.add(line.rsplit("__", 1)[0] if "__" in line else line)
    return names


def cmd_run(args: argparse.Namespace) -> int:
    err = Console(stderr=True)
    try:
        problems, refused = load_problems(args.problems)
    except (OSError, ValueError) as exc:
        err.print(f"codegym pipeline: {exc}")
        return 2
    for item in refused:
        err.print(f"refused {item.where}: {item.reason}")
    if args.only:
        try:
            wanted = named_problems(Path(args.only))
        except (OSError, ValueError) as exc:
            err.print(f"codegym pipeline: --only {args.only}: {exc}")
            return 2
        problems = [p for p in problems if p.question_id in wanted]
    if args.limit:
        problems = problems[: args.limit]
    if not problems:
        err.print("codegym pipeline: no usable problem")
        return 2
    problem = "" if args.synthesis else from_args(LLMSettings, args).missing_key()
    if problem:
        err.print(f"codegym pipeline: {problem}")
        return 2
    work = Path(args.work)
    state = PipelineState(work)
    state.add_problems(
        [
            (p.question_id, {"question_id": p.question_id, "entry_point": p.entry_point, "subset": p.subset})
            for p in problems
        ]
    )
    config = config_from(args)
    stages = config.active_stages()
    state.set_meta("stages", list(stages))
    library_path = Path(args.library) if args.library else work / "library.db"
    state.set_meta("library", str(library_path))
    started = time.monotonic()
    errors: list[str] = []

    async def main(synthesis: str, verification: str) -> None:
        async with (
            aio_channel(synthesis, [SYNTHESIS], access=client_access(args)) as syn,
            aio_channel(verification, [VERIFICATION], access=client_access(args)) as ver,
        ):
            with Library(library_path) as library, live_progress(err, len(problems), stages) as progress:

                def on_outcome(problem_id: str, stage: str, outcome: StageOutcome) -> None:
                    if outcome.status == "error":
                        errors.append(f"{problem_id} {stage}: {outcome.reason}")
                    progress(problem_id, stage, outcome)

                pipeline = Pipeline(state, library, syn, ver, config, on_outcome)
                await pipeline.run(problems)

    try:
        with local_services(args, work) as (synthesis, verification):
            asyncio.run(main(synthesis, verification))
    except KeyboardInterrupt:
        err.print("codegym pipeline: interrupted; run the same command again to continue")
        return 130
    except (RuntimeError, TimeoutError) as exc:
        err.print(f"codegym pipeline: {exc}")
        return 1
    state.set_meta("last_run_wall_s", round(time.monotonic() - started, 1))
    print_summary(
        state, stages, f"codegym pipeline: {len(problems)} problems, {time.monotonic() - started:.1f} s"
    )
    envs, tasks = Library(library_path).counts() if library_path.exists() else (0, 0)
    print(f"library {library_path}: {envs} environments, {tasks} task configs; work folder {work}")
    for line in errors[:20]:
        err.print(f"[red]error[/red] {line}")
    if errors:
        err.print(f"{len(errors)} problem(s) stopped on an error: run the same command again to retry them")
    state.close()
    return 1 if errors else 0


@contextmanager
def live_progress(
    console: Console, total: int, stages: tuple[str, ...]
) -> Iterator[Callable[[str, str, StageOutcome], None]]:
    """A bar of problems finished, with passed counts per stage in its description."""
    counts: Counter[str] = Counter()
    rejected: Counter[str] = Counter()
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as bar:
        task = bar.add_task("pipeline", total=total)

        def progress(problem_id: str, stage: str, outcome: StageOutcome) -> None:
            if outcome.status == "passed":
                counts[stage] += 1
            else:
                rejected[stage] += 1
            if outcome.status != "passed" or stage == stages[-1]:
                bar.advance(task)
            text = " · ".join(
                f"{SHORT[s]} {counts[s]}" + (f"/-{rejected[s]}" if rejected[s] else "") for s in stages
            )
            bar.update(task, description=text)

        yield progress


def cmd_status(args: argparse.Namespace) -> int:
    try:
        state = PipelineState.open_existing(args.work)
    except FileNotFoundError as exc:
        print(f"codegym pipeline status: {exc}", file=sys.stderr)
        return 2
    stages = tuple(state.meta("stages", list(STAGES)))
    wall = state.meta("last_run_wall_s")
    suffix = f" (last finished run: {wall} s)" if wall is not None else " (no run finished yet)"
    print_summary(state, stages, f"codegym pipeline status: {args.work}{suffix}")
    if args.problems:
        for report in state.problem_reports():
            reason = f": {report['reason']}" if report["reason"] else ""
            print(f"{report['problem_id']:<24} {report['stage']:<16} {report['status']}{reason}")
    state.close()
    return 0
