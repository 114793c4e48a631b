"""`codegym export`: the library's verified task configs as RL training instances.

    codegym export --library lib.db --out train.jsonl --split 0.1     # + train.val.jsonl

Writes CodeGym's training-instance format (JSONL or Parquet), one instance per task config whose
oracle step count (`solve_fc_round`) is within bounds. `--split` holds out whole environments
(chosen by a stable hash of their ids) into `OUT` with `.val` before the suffix.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from codegym.library import Library
from codegym_cli.export import TOOL_MODES, Difficulty, build_instances


def write(path: Path, items: list[dict[str, Any]], fmt: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(items), path)
        return
    with open(path, "w", encoding="utf-8") as out:
        for item in items:
            out.write(json.dumps(item, ensure_ascii=False) + "\n")


def validation_path(out: Path) -> Path:
    return out.with_name(f"{out.stem}.val{out.suffix}")


def cmd_export(args: argparse.Namespace) -> int:
    if not Path(args.library).exists():
        print(f"codegym export: library {args.library} does not exist", file=sys.stderr)
        return 2
    if not 0 <= args.split < 1:
        print("codegym export: --split is a fraction in [0, 1)", file=sys.stderr)
        return 2
    fmt = args.format or ("parquet" if args.out.endswith(".parquet") else "jsonl")
    difficulty = None
    if args.difficulty:
        try:
            difficulty = Difficulty.from_summary(args.difficulty, args.min_success, args.max_success)
        except (OSError, ValueError, KeyError) as exc:
            print(
                f"codegym export: --difficulty {args.difficulty}: not a codegym eval summary ({exc})",
                file=sys.stderr,
            )
            return 2
    with Library(args.library) as library:
        records = [r for r in library.load_all().values() if r.env_id.startswith(args.prefix)]
    result = build_instances(
        records,
        tools=args.tools,
        split=args.split,
        min_rounds=args.min_solve_fc_round,
        max_rounds=args.max_solve_fc_round,
        include_unverified=args.include_unverified,
        difficulty=difficulty,
        max_guess_rate=args.max_guess_rate,
    )
    out = Path(args.out)
    write(out, result.train, fmt)
    message = f"{len(result.train)} instances from {result.environments} environments in {out}"
    if args.split:
        write(validation_path(out), result.validation, fmt)
        message += (
            f"; {len(result.validation)} from {result.held_out_environments} held-out environments"
            f" in {validation_path(out)}"
        )
    print(message)
    if result.skipped_unverified or result.skipped_rounds:
        print(
            f"skipped {result.skipped_unverified} configs without an oracle step count (unverified) and"
            f" {result.skipped_rounds} outside [{args.min_solve_fc_round}, {args.max_solve_fc_round}] steps",
            file=sys.stderr,
        )
    if result.skipped_guessable:
        print(
            f"skipped {result.skipped_guessable} configs a blind Done answers right with chance above"
            f" {args.max_guess_rate}",
            file=sys.stderr,
        )
    if difficulty is not None:
        print(
            f"difficulty ({difficulty.name}): kept configs solved in {args.min_success:.0%}..{args.max_success:.0%}"
            f" of samples; dropped {result.skipped_difficulty} outside, {result.skipped_unevaluated} not evaluated",
            file=sys.stderr,
        )
    if not result.train and not result.validation:
        print("codegym export: nothing to export", file=sys.stderr)
        return 1
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    from codegym.library import default_library_path

    export = sub.add_parser(
        "export",
        help="write the library's verified task configs as training instances (JSONL or Parquet)",
        description=__doc__,
        formatter_class=lambda prog: argparse.RawDescriptionHelpFormatter(prog, max_help_position=40),
    )
    export.add_argument(
        "--library", default=str(default_library_path()), help="library (default: %(default)s)"
    )
    export.add_argument("--out", required=True, help="file to write (.jsonl or .parquet)")
    export.add_argument(
        "--format", choices=("jsonl", "parquet"), default="", help="default: from the --out suffix"
    )
    export.add_argument(
        "--tools",
        choices=TOOL_MODES,
        default="text",
        help="text: CodeGym's prompt (default); json: OpenAI tool schemas and a native-calling prompt;"
        " both: CodeGym's prompt plus the schemas",
    )
    export.add_argument(
        "--split", type=float, default=0.0, help="fraction of environments held out (default 0)"
    )
    export.add_argument("--prefix", default="", help="only env ids starting with this")
    export.add_argument("--min-solve-fc-round", type=int, default=10, help="fewest oracle steps (default 10)")
    export.add_argument("--max-solve-fc-round", type=int, default=256, help="most oracle steps (default 256)")
    export.add_argument(
        "--include-unverified", action="store_true", help="also configs without an oracle step count"
    )
    export.add_argument(
        "--max-guess-rate",
        type=float,
        default=None,
        help="drop configs whose guess_rate (the chance a blind Done is right) is above this;"
        " configs without one are kept",
    )
    export.add_argument(
        "--difficulty",
        default="",
        help="summary.json of a `codegym eval` run: filter configs by its success rates",
    )
    export.add_argument(
        "--max-success",
        type=float,
        default=0.25,
        help="with --difficulty: highest success rate kept (default 0.25)",
    )
    export.add_argument(
        "--min-success",
        type=float,
        default=0.0,
        help="with --difficulty: lowest success rate kept (default 0)",
    )
    export.set_defaults(func=cmd_export)
