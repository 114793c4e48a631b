"""`codegym synthesize`: problems in, environments + unit tests + solve() candidates out.

Runs the three LLM stages for every problem of a JSONL or Parquet file against any
OpenAI-compatible endpoint, with a progress display and a per-stage summary. Responses are
cached in OUT/llm_cache.db, so rerunning (or resuming after an interruption) is free.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from services.synthesis.llm import LLMGateway, LLMSettings, StageParams
from services.synthesis.llm_cache import ResponseCache
from services.synthesis.pipeline import synthesize_all
from services.synthesis.problems import load_problems
from services.synthesis.stages import STAGES, StageDefaults, Synthesizer

PARAM_TYPES = {f.name: f.type for f in fields(StageParams)}


def stage_defaults(overrides: list[str]) -> StageDefaults:
    """Apply `STAGE.KEY=VALUE` overrides (e.g. `solve_functions.samples=10`) to the defaults."""
    defaults = StageDefaults()
    for item in overrides:
        target, sep, value = item.partition("=")
        stage, dot, key = target.partition(".")
        if not sep or not dot or stage not in STAGES or key not in PARAM_TYPES:
            raise SystemExit(
                f"codegym synthesize: bad --stage {item!r}: expected STAGE.KEY=VALUE with STAGE in "
                f"{', '.join(STAGES)} and KEY in {', '.join(PARAM_TYPES)}"
            )
        kind = {"str": str, "float": float, "int": int}[str(PARAM_TYPES[key])]
        try:
            typed: Any = kind(value)
        except ValueError:
            raise SystemExit(
                f"codegym synthesize: --stage {item!r}: {value!r} is not a {kind.__name__}"
            ) from None
        setattr(defaults, stage, replace(defaults.for_stage(stage), **{key: typed}))
    return defaults


def settings_from(args: argparse.Namespace) -> LLMSettings:
    api_key = args.llm_api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
    return LLMSettings(
        base_url=args.llm_base_url,
        api_key=api_key,
        model=args.model,
        timeout_s=args.timeout_s,
        max_concurrency=args.concurrency,
        max_retries=args.max_retries,
        backoff_s=args.backoff_s,
    )


def missing_api_key(args: argparse.Namespace) -> str:
    """Why the run cannot start ("" when it can): a remote endpoint without an API key."""
    from urllib.parse import urlparse

    host = urlparse(args.llm_base_url).hostname or ""
    local = host in ("localhost", "::1") or host.startswith("127.")
    if local or args.llm_api_key or os.environ.get("OPENAI_API_KEY"):
        return ""
    return f"{args.llm_base_url} needs an API key: set OPENAI_API_KEY or pass --llm-api-key"


def add_llm_arguments(parser: argparse.ArgumentParser, *, stages: bool = True) -> None:
    parser.add_argument(
        "--llm-base-url",
        default=os.environ.get("OPENAI_BASE_URL", "https://api.openai.com/v1"),
        help="OpenAI-compatible endpoint (OpenAI, vLLM, SGLang, Ollama, ...)",
    )
    parser.add_argument("--llm-api-key", default="", help="API key (default: $OPENAI_API_KEY)")
    parser.add_argument("--model", default="gpt-4o-mini", help="model for every stage (see --stage)")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="deadline of one LLM request")
    parser.add_argument("--max-retries", type=int, default=6, help="retries on 429, 5xx, timeouts")
    parser.add_argument("--backoff-s", type=float, default=1.0, help="first retry delay (doubles)")
    if not stages:
        return
    parser.add_argument(
        "--stage",
        action="append",
        default=[],
        metavar="STAGE.KEY=VALUE",
        help="per-stage override, e.g. solve_functions.samples=10 or environment.model=gpt-4o "
        f"(stages: {', '.join(STAGES)}; keys: {', '.join(PARAM_TYPES)})",
    )
    parser.add_argument("--concurrency", type=int, default=16, help="LLM requests in flight")


def cmd_synthesize(args: argparse.Namespace) -> int:
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
    problem = missing_api_key(args)
    if problem:
        console.print(f"[red]codegym synthesize: {problem}[/red]")
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    defaults = stage_defaults(args.stage)

    async def main() -> dict[str, Any]:
        cache = ResponseCache(args.cache or out / "llm_cache.db")
        gateway = LLMGateway(settings_from(args), cache)
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
    table = Table(
        title=f"codegym synthesize: {report['environments']}/{len(problems)} problems got an environment"
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
    print(f"results in {out} (summary.json); refused rows: {len(errors)}")
    return 1 if report["errors"] else 0


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
