"""What `codegym library import|list|show|oracle` does; its options are in library_options.py.

`replay` lives in library_replay.py; `stats|sample|quarantine|label`, which read the runtime's
record of served episodes, in library_curriculum.py."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

from codegym.library.store import ImportReport, Library
from codegym_cli.access import client_access


def _import(args: argparse.Namespace) -> int:
    bar = None if args.quiet or args.json or not sys.stderr.isatty() else ImportBar()
    with Library(args.library) as library, bar or contextlib.nullcontext():
        report = library.import_paths(
            args.paths, on_conflict=args.on_conflict, progress=bar, jobs=args.jobs or None
        )
        envs, tasks = library.counts()
    held = {"library": args.library, "envs": envs, "tasks": tasks}
    if args.report:
        Path(args.report).write_text(json.dumps({**report.as_dict(), "library": held}, indent=2) + "\n")
    if args.json:
        print(json.dumps({**report.as_dict(), "library": held}, indent=2))
    else:
        print(import_table(report))
        print_details(report, args.on_conflict)
        print(
            f"{len(report.added)} added, {len(report.updated)} updated, {len(report.unchanged)} unchanged, "
            f"{report.skipped_count} skipped; {report.tasks_added} new task configs "
            f"({report.tasks_present} already present). Library {args.library}: {envs} envs, {tasks} tasks."
        )
    usable = report.added or report.updated or report.unchanged or report.tasks_added or report.tasks_present
    if not usable and not report.conflicts:
        print("codegym library import: nothing usable was imported", file=sys.stderr)
        return 1
    if report.refused:
        return 1
    return 1 if report.skipped_count and args.strict else 0


class ImportBar:
    """The import's progress on stderr (rich): a bar per source, rows read against rows published."""

    def __init__(self) -> None:
        from codegym_cli.progress import stderr_progress

        self.bar = stderr_progress(transient=False)
        self.current: Any = None

    def __enter__(self) -> ImportBar:
        self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.stop()

    def start(self, name: str, total: int | None) -> None:
        self.current = self.bar.add_task(name, total=total)

    def advance(self, rows: int) -> None:
        self.bar.advance(self.current, rows)


def import_table(report: ImportReport) -> str:
    """The report as a table, a line per source: what its rows became."""
    header = ["source", "kind", "rows", "envs +", "updated", "unchanged", "duplicate", "conflict"]
    header += ["tasks +", "present", "duplicate", "other code", "skipped"]
    lines = []
    for s in report.sources:
        counts = [s.rows, s.envs_added, s.envs_updated, s.envs_unchanged, sum(s.env_duplicates.values())]
        counts += [
            s.conflicts,
            s.tasks_added,
            s.tasks_present,
            s.task_duplicates,
            s.other_code,
            s.skipped_rows,
        ]
        lines.append([s.name, s.kind, *(f"{n:,}" for n in counts)])
    totals = [sum(int(line[i].replace(",", "")) for line in lines) for i in range(2, len(header))]
    lines.append(["total", "", *(f"{n:,}" for n in totals)])
    widths = [max(len(str(row[i])) for row in [header, *lines]) for i in range(len(header))]

    def render(row: list[str]) -> str:
        cells = [
            f"{cell:<{w}}" if i < 2 else f"{cell:>{w}}"
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ]
        return "  ".join(cells).rstrip()

    return "\n".join(render(row) for row in [header, *lines])


def print_details(report: ImportReport, on_conflict: str) -> None:
    """Duplicates, conflicts and skips, each with a few examples, on stderr."""
    for s in report.sources:
        for first, n in s.env_duplicates.items():
            print(
                f"duplicate {s.name}: {n:,} environment rows are the same key and code as {first}'s",
                file=sys.stderr,
            )
        for reason, skips in s.skipped.items():
            print(f"skipped   {s.name}: {skips.count:,} x {reason}", file=sys.stderr)
            for where, detail in skips.examples:
                print(f"skipped   {where}: {reason}" + (f": {detail}" if detail else ""), file=sys.stderr)
    groups: dict[tuple[str, str, str], list[str]] = {}
    for c in report.conflicts:
        groups.setdefault((c.file, c.other, c.resolution), []).append(c.env_id)
    for (file, other, resolution), keys in groups.items():
        examples = ", ".join(keys[:5]) + (", ..." if len(keys) > 5 else "")
        print(
            f"conflict  {len(keys):,} environments of {file} have other code in the library (from {other}):"
            f" {resolution}; e.g. {examples}",
            file=sys.stderr,
        )
    if report.refused:
        print(
            f"conflict  {len(report.refused):,} refused: the library keeps its code; --on-conflict keep"
            " says so without an error, --on-conflict replace takes the new code (--json lists every key)",
            file=sys.stderr,
        )


def _existing(path: str) -> bool:
    """Reading commands never create a library: a mistyped path is an error, not an empty library."""
    if Path(path).is_file():
        return True
    print(f"codegym library: no library at {path} (build one with 'codegym library import')", file=sys.stderr)
    return False


def _list(args: argparse.Namespace) -> int:
    """A page of environments at a time: the published library is 20,000+ of them."""
    if not _existing(args.library):
        return 2
    with Library(args.library, read_only=True) as library:
        after, width = "", 0
        if not args.json:
            print(f"{'env_id':<48}  tasks  tools")
        while page := library.page(args.prefix, after, 256):
            for env_id, tools, tasks in page:
                if args.json:
                    print(json.dumps({"env_id": env_id, "tools": tools, "tasks": tasks}))
                else:
                    width = max(width, 48, len(env_id))
                    print(f"{env_id:<{width}}  {tasks:>5}  {', '.join(tools)}")
            after = page[-1][0]
    return 0


def _show(args: argparse.Namespace) -> int:
    if not _existing(args.library):
        return 2
    with Library(args.library) as library:
        record = library.get(args.env_id)
    if record is None:
        print(f"error: no environment {args.env_id!r} in {args.library}", file=sys.stderr)
        return 1
    if args.json:
        print(
            json.dumps(
                {
                    "env_id": record.env_id,
                    "sha256": record.sha256,
                    "task_text": record.task_text,
                    "metadata": record.metadata,
                    "tools": [t.schema for t in record.tools],
                    "tasks": [
                        {
                            "config": json.loads(t.config_json),
                            "config_text": t.published_config,
                            "difficulty": t.difficulty,
                            "solve_fc_round": t.solve_fc_round,
                            "scores": t.scores,
                            "source_sha": t.source_sha,
                        }
                        for t in record.tasks
                    ],
                },
                indent=2,
            )
        )
        return 0
    print(f"# {record.env_id}  (sha256 {record.sha256[:12]}, {len(record.tasks)} tasks)\n")
    origin = record.metadata.get("origin")
    if isinstance(origin, dict):
        print("origin: " + ", ".join(f"{k} {v}" for k, v in origin.items() if v))
    report = record.metadata.get("verification")
    if isinstance(report, dict):
        for stage, facts in report.items():
            print(f"verification {stage}: {json.dumps(facts, sort_keys=True)}")
    if origin or report:
        print()
    print(record.task_text or "(no task text)")
    print(record.tools_text)
    for task in record.tasks[: args.tasks]:
        recorded = f"  (recorded with code {task.source_sha[:12]})" if task.source_sha else ""
        print(f"[{task.difficulty or '-'}] {task.published_config}{recorded}")
    return 0


def _oracle(args: argparse.Namespace) -> int:
    import asyncio

    from codegym.library.store import TaskRecord
    from codegym_jobs.oracle import record_oracle, write_trajectories

    if not _existing(args.library):
        return 2
    with Library(args.library) as library:
        records = [r for r in library.load_all().values() if r.env_id.startswith(args.prefix)]
        trajectories = asyncio.run(record_oracle(records, args.sandbox, access=client_access(args)))
        solved = [t for t in trajectories if t.get("reward") == 1 and "steps" in t]
        library.add_tasks(
            TaskRecord(
                t["env_id"], json.dumps(t["config"], ensure_ascii=False), t["difficulty"], len(t["steps"])
            )
            for t in solved
        )
    write_trajectories(args.out, trajectories)
    for t in trajectories:
        if t not in solved:
            print(
                f"unsolved  {t['env_id']} {json.dumps(t['config'])[:80]}: {t['status']} {t.get('message', '')}"
            )
    print(f"{len(solved)}/{len(trajectories)} tasks solved by their oracle; trajectories in {args.out}")
    return 0 if len(solved) == len(trajectories) else 1
