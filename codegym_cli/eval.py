"""What `codegym eval` does; its options and description are in eval_options.py."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from codegym.contract import parse_ability
from codegym.library.store import Library, canonical_config
from codegym.server.settings import from_args
from codegym_cli.access import client_access
from codegym_client import AsyncRuntimeClient, RuntimeUnavailable
from codegym_jobs.evaluation.evaluator import (
    EvalTask,
    Evaluator,
    RunCounts,
    run_episodes,
    tasks_from_instances,
    tasks_from_library,
)
from codegym_jobs.evaluation.results import COUNTED_REASONS, FAILURE_REASONS, done_keys, summarize
from services.synthesis.llm import LLMGateway, StageParams
from services.synthesis.settings import LLMSettings


def load_tasks(args: argparse.Namespace) -> list[EvalTask]:
    if args.instances:
        if args.learnability is not None:
            raise ValueError(
                "--learnability filters a library's labels: play --library, or export the labelled"
                " instances first (codegym export --learnability)"
            )
        tasks = tasks_from_instances(args.instances)
    else:
        if not Path(args.library).is_file():
            raise ValueError(f"no library at {args.library}")
        tasks = tasks_from_library(args.library, args.tool_mode, args.prefix, args.learnability)
    tasks = [t for t in tasks if t.env_id.startswith(args.prefix)]
    return tasks[: args.limit] if args.limit else tasks


def summary_table(summary: dict[str, Any]) -> Table:
    k = summary["samples"]
    table = Table(title=f"codegym eval: {summary['model']}, {k} sample(s) per task")
    columns = (
        "environment",
        "tasks",
        "episodes",
        "success",
        "pass@1",
        f"pass@{k}",
        "mean turns",
        "tokens in/out",
        "end reasons",
        "not counted",
    )
    for column in columns:
        table.add_column(column, justify="left" if column in ("environment", "end reasons") else "right")

    def row(name: str, f: dict[str, Any]) -> None:
        if not f.get("episodes"):  # only failed attempts: no figure to show
            table.add_row(name, "0", "0", *["-"] * 6, str(f.get("not_counted", 0)))
            return
        reasons = ", ".join(f"{r} {f['end_reasons'][r]}" for r in COUNTED_REASONS if r in f["end_reasons"])
        table.add_row(
            name,
            str(f["tasks"]),
            str(f["episodes"]),
            f"{f['success_rate']:.1%}",
            f"{f['pass@1']:.3f}",
            f"{f[f'pass@{k}']:.3f}",
            f"{f['mean_turns']:.1f}",
            f"{f['prompt_tokens']}/{f['completion_tokens']}",
            reasons,
            str(f.get("not_counted", 0)),
        )

    for env, figures in summary["environments"].items():
        row(env, figures)
    if summary["overall"]:
        row("all", summary["overall"])
    return table


def store_scores(library_path: str, summary: dict[str, Any]) -> int:
    """Each config's success rate over its counted episodes, into the library (matched by env id
    and config). `summary["configs"]` holds only configs with a counted episode: a config whose
    every attempt failed outside the agent gets no score, rather than a 0 that would make it
    "hard" for `codegym export --difficulty`."""
    scores = []
    for ability, figures in summary["configs"].items():
        if not figures["samples"]:
            continue
        parsed = parse_ability(ability)
        scores.append(
            (parsed.env_id, canonical_config(parsed.config), summary["score_name"], figures["success_rate"])
        )
    with Library(library_path) as library:
        return library.set_scores(scores)


def report(summary: dict[str, Any], counts: RunCounts, out: Path, give_up_after: int) -> list[str]:
    """The lines after the table: what this run played, and what was not counted and why."""
    counted = summary["overall"].get("episodes", 0)
    lines = [
        f"{counts.played} episodes played now ({counts.counted} counted, {counts.failed} not counted); "
        f"{counted} counted episodes in {out}/episodes.jsonl"
    ]
    missing = summary["not_counted"]
    if missing["episodes"]:
        reasons = ", ".join(
            f"{r} {missing['reasons'][r]}" for r in FAILURE_REASONS if r in missing["reasons"]
        )
        lines.append(
            f"{missing['episodes']} episodes not counted ({reasons}): they failed outside the agent, "
            f"are kept in {out}/failures.jsonl and are played again by the same command; errors:"
        )
        lines += [f"  {e['episodes']} × {e['error']}" for e in missing["errors"]]
    if counts.skipped:
        lines.append(
            f"stopped after {give_up_after} failed attempts in a row: {counts.skipped} episodes not "
            "played; run the same command again once the runtime and the endpoint answer"
        )
    return lines


class EpisodeBar:
    """The progress line of a run: episodes done (those of an earlier run included), how many the
    agent solved, how many were not counted, and the model's turns per second."""

    def __init__(self, bar: Progress, total: int, already: int) -> None:
        self.bar = bar
        self.job = bar.add_task("episodes", total=total, completed=already)
        self.started = time.monotonic()
        self.solved = self.failed = self.turns = 0

    def __call__(self, result: dict[str, Any]) -> None:
        self.solved += result["end_reason"] == "solved"
        self.failed += not result["counted"]
        self.turns += result["turns"]
        rate = self.turns / max(1e-9, time.monotonic() - self.started)
        self.bar.update(
            self.job,
            advance=1,
            description=f"episodes ({self.solved} solved, {self.failed} not counted, {rate:.0f} turns/s)",
        )


async def play(
    args: argparse.Namespace,
    tasks: list[EvalTask],
    llm: LLMSettings,
    out: Path,
    err: Console,
    give_up_after: int,
) -> RunCounts:
    """Every task's samples not yet in OUT played through the runtime, with a progress bar."""
    params = StageParams(
        model=args.model, temperature=args.temperature, top_p=1.0, max_tokens=args.max_tokens, samples=1
    )
    gateway = LLMGateway(llm, cache=None)  # samples must differ: no response cache
    try:
        async with AsyncRuntimeClient(
            args.target, timeout_s=args.step_timeout_s, access=client_access(args)
        ) as runtime:
            # A runtime still starting (`codegym up &` just before) is waited for; one that never
            # answers plays nothing, rather than a failed attempt per episode.
            await runtime.wait_ready(args.wait_s)
            evaluator = Evaluator(
                runtime, gateway, params, tool_mode=args.tool_mode, max_turns=args.max_turns
            )
            columns = (
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
            )
            with Progress(*columns, console=err, transient=False) as bar:
                wanted = {f"{t.ability}#{s}" for t in tasks for s in range(args.samples)}
                already = len(done_keys(out / "episodes.jsonl") & wanted)
                progress = EpisodeBar(bar, len(tasks) * args.samples, already)
                return await run_episodes(
                    evaluator,
                    tasks,
                    args.samples,
                    out,
                    args.concurrency,
                    progress,
                    give_up_after=give_up_after,
                )
    finally:
        await gateway.close()


def write_results(
    args: argparse.Namespace,
    tasks: list[EvalTask],
    counts: RunCounts,
    out: Path,
    wall_s: float,
    give_up_after: int,
) -> None:
    """OUT/summary.json, the table, what was not counted, and the scores written into the library."""
    summary = summarize(out / "episodes.jsonl", args.samples, args.model)
    summary["wall_s_last_run"] = round(wall_s, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    Console(width=None if Console().is_terminal else 180).print(summary_table(summary))
    lines = report(summary, counts, out, give_up_after)
    if args.library and not args.instances:
        stored = store_scores(args.library, summary)
        unscored = len({t.ability for t in tasks} - set(summary["configs"]))
        lines.append(
            f"{stored} configs scored in {args.library} as {summary['score_name']}"
            + (f"; {unscored} configs without a counted episode not scored" if unscored else "")
        )
    print("\n".join(lines))


def cmd_eval(args: argparse.Namespace) -> int:
    err = Console(stderr=True)
    try:
        tasks = load_tasks(args)
    except (OSError, ValueError) as exc:
        err.print(f"codegym eval: {exc}")
        return 2
    if not tasks:
        err.print("codegym eval: no task to play")
        return 2
    llm = from_args(LLMSettings, args)
    problem = llm.missing_key()
    if problem:
        err.print(f"codegym eval: {problem}")
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    # An outage fails every attempt, each after its own retries: stop starting new ones soon.
    give_up_after = max(16, 2 * args.concurrency) if args.give_up_after == "auto" else int(args.give_up_after)
    try:
        counts = asyncio.run(play(args, tasks, llm, out, err, give_up_after))
    except RuntimeUnavailable as exc:
        err.print(f"codegym eval: {exc}; nothing played")
        return 1
    except KeyboardInterrupt:
        err.print("codegym eval: interrupted; run the same command again to continue")
        return 130
    write_results(args, tasks, counts, out, time.monotonic() - started, give_up_after)
    return 1 if counts.failed or counts.skipped else 0
