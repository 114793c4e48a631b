"""`codegym synthesize`: problems in, environments + unit tests + solve() candidates out.

Runs the three LLM stages for every problem of a JSONL or Parquet file against any
OpenAI-compatible endpoint, with a progress display and a per-stage summary. Responses are
cached in OUT/llm_cache.db, so rerunning (or resuming after an interruption) is free.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from codegym.server.settings import add_arguments, from_args
from services.synthesis.settings import LLMSettings, Stages

if TYPE_CHECKING:
    from rich.console import Console

    from services.synthesis.stages import StageDefaults


def stage_defaults(args: argparse.Namespace, command: str = "codegym synthesize") -> StageDefaults:
    """The stages' defaults with `--stage STAGE.KEY=VALUE` overrides; a bad one ends the command."""
    from services.synthesis.stages import StageDefaults

    try:
        return StageDefaults.overridden(from_args(Stages, args).overrides)
    except ValueError as exc:
        raise SystemExit(f"{command}: {exc}") from None


def add_llm_arguments(parser: argparse.ArgumentParser, *, stages: bool = True) -> None:
    """The LLM endpoint's options (`LLMSettings`), and with `stages` the per-stage overrides."""
    add_arguments(LLMSettings, parser)
    if stages:
        add_arguments(Stages, parser)


def cmd_synthesize(args: argparse.Namespace) -> int:
    import asyncio

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from services.synthesis.llm import LLMGateway
    from services.synthesis.llm_cache import ResponseCache
    from services.synthesis.pipeline import synthesize_all
    from services.synthesis.problems import load_problems
    from services.synthesis.stages import STAGES, Synthesizer

    console = Console(stderr=True)
    try:
        problems, errors = load_problems(args.problems)
    except (OSError, ValueError) as exc:
        console.print(f"[red]codegym synthesize: {exc}[/red]")
        return 2
    for error in errors:
        console.print(f"[yellow]refused[/yellow] {error.where}: {error.reason}")
    if not problems:
        console.print("[red]codegym synthesize: no usable problem[/red]")
        return 2
    settings = from_args(LLMSettings, args)
    problem = settings.missing_key()
    if problem:
        console.print(f"[red]codegym synthesize: {problem}[/red]")
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    defaults = stage_defaults(args)

    async def main() -> dict[str, Any]:
        cache = ResponseCache(args.cache or out / "llm_cache.db")
        gateway = LLMGateway(settings, cache)
        try:
            with Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=console,
                transient=False,
            ) as bar:
                task = bar.add_task("synthesizing", total=len(problems) * len(STAGES))

                def progress(qid: str, stage: str, ok: int, bad: int, reasons: list[str]) -> None:
                    bar.advance(task, len(STAGES) if stage == "error" else 1)
                    bar.update(task, description=f"{qid} {stage}: {ok} ok, {bad} rejected")

                return await synthesize_all(
                    Synthesizer(gateway, defaults), problems, out, progress, args.parallel
                )
        finally:
            await gateway.close()
            cache.close()

    report = asyncio.run(main())
    print_report(report, len(problems), console)
    print(f"results in {out} (summary.json); refused rows: {len(errors)}")
    return 1 if report["errors"] else 0


def print_report(report: dict[str, Any], problems: int, console: Console) -> None:
    """Per stage: accepted, rejected and why, LLM requests and tokens; then each error once."""
    from rich.console import Console
    from rich.table import Table

    from services.synthesis.stages import STAGES

    table = Table(
        title=f"codegym synthesize: {report['environments']}/{problems} problems got an environment"
    )
    for column in ("stage", "accepted", "rejected", "reasons", "requests", "cached", "tokens in/out"):
        table.add_column(column)
    for stage in STAGES:
        counts = report["stages"][stage]
        usage = report["usage"].get(stage, {})
        reasons = ", ".join(
            f"{k} ×{v}" for k, v in sorted(counts["reasons"].items(), key=lambda kv: -kv[1])[:4]
        )
        table.add_row(
            stage,
            str(counts["accepted"]),
            str(counts["rejected"]),
            reasons or "-",
            str(usage.get("requests", 0)),
            str(usage.get("cache_hits", 0)),
            f"{usage.get('prompt_tokens', 0)}/{usage.get('completion_tokens', 0)}",
        )
    Console(width=None if Console().is_terminal else 160).print(table)
    by_error: dict[str, list[str]] = {}
    for qid, text in report["errors"].items():
        by_error.setdefault(text.split(": ", 1)[-1], []).append(qid)
    for text, qids in by_error.items():
        who = qids[0] if len(qids) == 1 else f"{len(qids)} problems ({qids[0]}, ...)"
        console.print(f"[red]{who}[/red]: {text}")


def register(sub: argparse._SubParsersAction) -> None:
    synth = sub.add_parser(
        "synthesize",
        help="turn problems (JSONL/Parquet) into environments, unit tests and solve() candidates with an LLM",
        description=__doc__,
    )
    synth.add_argument("--problems", required=True, help="JSONL or Parquet: question_id, question, solution")
    synth.add_argument("--out", required=True, help="output folder")
    synth.add_argument("--cache", default="", help="response cache (default OUT/llm_cache.db)")
    synth.add_argument("--parallel", type=int, default=8, help="problems in flight")
    add_llm_arguments(synth)
    synth.set_defaults(func=cmd_synthesize)
