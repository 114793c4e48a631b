"""`codegym library import|list|show`: build and inspect an environment library (SQLite)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from codegym.library import Library, default_library_path


def _import(args: argparse.Namespace) -> int:
    with Library(args.library) as library:
        report = library.import_paths(args.paths)
        envs, tasks = library.counts()
    for env_id in report.added:
        print(f"added     {env_id}")
    for env_id in report.updated:
        print(f"updated   {env_id}")
    for where, reason in report.skipped:
        print(f"skipped   {where}: {reason}", file=sys.stderr)
    print(
        f"{len(report.added)} added, {len(report.updated)} updated, {len(report.unchanged)} unchanged, "
        f"{len(report.skipped)} skipped; {report.tasks_added} new task configs "
        f"({report.tasks_present} already present). Library {args.library}: {envs} envs, {tasks} tasks."
    )
    usable = report.added or report.updated or report.unchanged or report.tasks_added or report.tasks_present
    if not usable:
        print("codegym library import: nothing usable was imported", file=sys.stderr)
        return 1
    return 1 if report.skipped and args.strict else 0


def _existing(path: str) -> bool:
    """Reading commands never create a library: a mistyped path is an error, not an empty library."""
    if Path(path).is_file():
        return True
    print(f"codegym library: no library at {path} (build one with 'codegym library import')", file=sys.stderr)
    return False


def _list(args: argparse.Namespace) -> int:
    if not _existing(args.library):
        return 2
    with Library(args.library) as library:
        records = library.load_all()
    rows = [r for r in records.values() if r.env_id.startswith(args.prefix)]
    if args.json:
        for r in rows:
            print(json.dumps({"env_id": r.env_id, "tools": r.tool_names, "tasks": len(r.tasks)}))
        return 0
    width = max((len(r.env_id) for r in rows), default=6)
    print(f"{'env_id':<{width}}  tasks  tools")
    for r in rows:
        print(f"{r.env_id:<{width}}  {len(r.tasks):>5}  {', '.join(r.tool_names)}")
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
                            "difficulty": t.difficulty,
                            "solve_fc_round": t.solve_fc_round,
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
        print(f"[{task.difficulty or '-'}] {task.config_json}")
    return 0


def _oracle(args: argparse.Namespace) -> int:
    import asyncio

    from codegym.library import TaskRecord
    from codegym_cli.oracle import record_oracle, write_trajectories

    if not _existing(args.library):
        return 2
    with Library(args.library) as library:
        records = [r for r in library.load_all().values() if r.env_id.startswith(args.prefix)]
        trajectories = asyncio.run(record_oracle(records, args.sandbox))
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


def register(sub: argparse._SubParsersAction) -> None:
    library = sub.add_parser("library", help="build and inspect an environment library (SQLite)")
    lib_sub = library.add_subparsers(dest="library_command", required=True, metavar="ACTION")

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--library", default=str(default_library_path()), help="library file (default: %(default)s)"
        )

    imp = lib_sub.add_parser(
        "import",
        help="import env files {code_id}__{Env}.py, folders of them, task/training-instance JSONL",
        description="Validates every source with the contract checker; re-importing is idempotent. "
        "JSONL lines are CodeGym training instances (ability, prompt, extra_info.solve_fc_round) or "
        "task lines (env_id, config, difficulty).",
    )
    imp.add_argument("paths", nargs="+", help="files or folders")
    imp.add_argument("--strict", action="store_true", help="exit 1 when anything was skipped")
    common(imp)
    imp.set_defaults(func=_import)

    ls = lib_sub.add_parser("list", help="environments with their task counts and tools")
    ls.add_argument("--prefix", default="", help="only env ids starting with this")
    ls.add_argument("--json", action="store_true", help="one JSON object per line")
    common(ls)
    ls.set_defaults(func=_list)

    show = lib_sub.add_parser("show", help="one environment: task text, tools, task configs")
    show.add_argument("env_id")
    show.add_argument("--tasks", type=int, default=20, help="task configs to print")
    show.add_argument("--json", action="store_true", help="print JSON")
    common(show)
    show.set_defaults(func=_show)

    oracle = lib_sub.add_parser(
        "oracle",
        help="play every task with its env's own solve() in a sandbox; write the trajectories as JSONL",
        description="Records solve_fc_round (the oracle's step count) in the library too.",
    )
    oracle.add_argument("--out", required=True, help="trajectory JSONL to write")
    oracle.add_argument("--prefix", default="", help="only env ids starting with this")
    oracle.add_argument("--sandbox", default="", help="HOST:PORT of a sandbox worker; empty starts one")
    common(oracle)
    oracle.set_defaults(func=_oracle)
