"""`codegym eval`: play a model as an agent on every task through the runtime; figures per environment.

    codegym eval --target 127.0.0.1:50051 --library lib.db --llm-base-url URL --model M --samples 4 --out ev1

Writes OUT/episodes.jsonl (one line per finished episode: messages, actions, observations, reward,
turns, tokens, end reason) and OUT/summary.json (success rate, pass@1, pass@k, mean turns, tokens,
end reasons; per environment, overall and per task config), and prints the table. Run the same
command again after an interruption: finished episodes are kept, the rest are played. With
--library, each config's success rate is stored in the library as `{model}_Bo{k}_score`, which
`codegym export` writes into extra_info (and `--difficulty` filters on).
"""

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

from clients.runtime_client import AsyncRuntimeClient
from codegym.contract import parse_ability
from codegym_cli.evaluation import (
    END_REASONS,
    EvalTask,
    Evaluator,
    run_episodes,
    summarize,
    tasks_from_instances,
    tasks_from_library,
)
from codegym_cli.synthesize_command import add_llm_arguments, missing_api_key, settings_from
from services.runtime.library import Library, canonical_config
from services.synthesis.llm import LLMGateway, StageParams


def load_tasks(args: argparse.Namespace) -> list[EvalTask]:
    if args.instances:
        tasks = tasks_from_instances(args.instances)
    else:
        if not Path(args.library).is_file():
            raise ValueError(f"no library at {args.library}")
        tasks = tasks_from_library(args.library, args.tool_mode, args.prefix)
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
    )
    for column in columns:
        table.add_column(column, justify="left" if column in ("environment", "end reasons") else "right")

    def row(name: str, f: dict[str, Any]) -> None:
        reasons = ", ".join(f"{r} {f['end_reasons'][r]}" for r in END_REASONS if r in f["end_reasons"])
        table.add_row(
            name, str(f["tasks"]), str(f["episodes"]), f"{f['success_rate']:.1%}", f"{f['pass@1']:.3f}",
            f"{f[f'pass@{k}']:.3f}", f"{f['mean_turns']:.1f}", f"{f['prompt_tokens']}/{f['completion_tokens']}", reasons,
        )  # fmt: skip

    for env, figures in summary["environments"].items():
        row(env, figures)
    if summary["overall"]:
        row("all", summary["overall"])
    return table


def store_scores(library_path: str, summary: dict[str, Any]) -> int:
    """Each evaluated config's success rate, into the library (matched by env id and config)."""
    scores = []
    for ability, figures in summary["configs"].items():
        parsed = parse_ability(ability)
        scores.append(
            (parsed.env_id, canonical_config(parsed.config), summary["score_name"], figures["success_rate"])
        )
    with Library(library_path) as library:
        return library.set_scores(scores)


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
    problem = missing_api_key(args)
    if problem:
        err.print(f"codegym eval: {problem}")
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    params = StageParams(
        model=args.model, temperature=args.temperature, top_p=1.0, max_tokens=args.max_tokens, samples=1
    )
    total = len(tasks) * args.samples
    started = time.monotonic()

    async def main() -> int:
        gateway = LLMGateway(settings_from(args), cache=None)  # samples must differ: no response cache
        try:
            async with AsyncRuntimeClient(args.target, timeout_s=args.step_timeout_s) as runtime:
                evaluator = Evaluator(
                    runtime, gateway, params, tool_mode=args.tool_mode, max_turns=args.max_turns
                )
                with Progress(
                    TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=err, transient=False,
                ) as bar:  # fmt: skip
                    from codegym_cli.evaluation import done_keys

                    already = len(
                        done_keys(out / "episodes.jsonl")
                        & {f"{t.ability}#{s}" for t in tasks for s in range(args.samples)}
                    )
                    job = bar.add_task("episodes", total=total, completed=already)
                    solved = [0, 0]

                    def progress(result: dict[str, Any]) -> None:
                        solved[0] += result["end_reason"] == "solved"
                        solved[1] += result["turns"]
                        rate = solved[1] / max(1e-9, time.monotonic() - started)
                        bar.update(
                            job, advance=1, description=f"episodes ({solved[0]} solved, {rate:.0f} turns/s)"
                        )

                    return await run_episodes(evaluator, tasks, args.samples, out, args.concurrency, progress)
        finally:
            await gateway.close()

    try:
        played = asyncio.run(main())
    except KeyboardInterrupt:
        err.print("codegym eval: interrupted; run the same command again to continue")
        return 130
    summary = summarize(out / "episodes.jsonl", args.samples, args.model)
    summary["wall_s_last_run"] = round(time.monotonic() - started, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    Console(width=None if Console().is_terminal else 180).print(summary_table(summary))
    note = f"{played} episodes played now, {summary['overall'].get('episodes', 0)} in {out}/episodes.jsonl"
    if args.library and not args.instances:
        note += f"; {store_scores(args.library, summary)} configs scored in {args.library} as {summary['score_name']}"
    print(note)
    errors = summary["overall"].get("end_reasons", {})
    return 1 if errors.get("llm_error") or errors.get("runtime_error") else 0


def register(sub: argparse._SubParsersAction) -> None:
    from services.runtime.library import default_library_path

    ev = sub.add_parser(
        "eval",
        help="play an OpenAI-compatible model as an agent on every task through the runtime",
        description=__doc__,
    )
    ev.add_argument("--target", default="127.0.0.1:50051", help="runtime HOST:PORT")
    source = ev.add_mutually_exclusive_group()
    source.add_argument(
        "--library", default=str(default_library_path()), help="play every task config of this library"
    )
    source.add_argument("--instances", default="", help="play these training instances (JSONL) instead")
    ev.add_argument("--out", required=True, help="folder for episodes.jsonl and summary.json")
    ev.add_argument("--samples", type=int, default=1, help="episodes per task (K of pass@K)")
    ev.add_argument("--concurrency", type=int, default=8, help="episodes in flight (and LLM requests)")
    ev.add_argument(
        "--tool-mode",
        choices=("text", "json"),
        default="text",
        help="function-call text or native tool calls",
    )
    ev.add_argument(
        "--max-turns", type=int, default=0, help="model replies per episode (0 = plugin_call_max_round)"
    )
    ev.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    ev.add_argument("--max-tokens", type=int, default=1024, help="completion token cap per reply")
    ev.add_argument("--prefix", default="", help="only env ids starting with this")
    ev.add_argument("--limit", type=int, default=0, help="only the first N tasks (0 = all)")
    ev.add_argument("--step-timeout-s", type=float, default=60.0, help="deadline of one runtime call")
    add_llm_arguments(ev, stages=False)
    ev.set_defaults(func=cmd_eval)
