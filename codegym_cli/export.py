"""What `codegym export` does; its options and description are in export_options.py, the export
itself in codegym_jobs/export/."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from codegym.library.store import Library
from codegym_jobs.export.instances import Difficulty
from codegym_jobs.export.writers import Selection, export, validation_path


def selection(args: argparse.Namespace) -> Selection:
    return Selection(
        prefix=args.prefix,
        split=args.split,
        tools=args.tools,
        min_rounds=args.min_solve_fc_round,
        max_rounds=args.max_solve_fc_round,
        include_unverified=args.include_unverified,
        max_guess_rate=args.max_guess_rate,
        learnability=args.learnability,
    )


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
    out = Path(args.out)
    # Read only: an export changes nothing in the library (not even an index it lacks).
    with Library(args.library, read_only=True) as library:
        try:
            result = export(library, out, fmt, selection(args), difficulty)
        except ValueError as exc:
            print(f"codegym export: {exc}", file=sys.stderr)
            return 1
    message = f"{result.train} instances from {result.environments} environments in {out}"
    if args.split:
        message += (
            f"; {result.validation} from {result.held_out_environments} held-out environments"
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
    if args.learnability is not None:
        print(
            f"learnability: kept configs labelled {', '.join(sorted(args.learnability))}; dropped"
            f" {result.skipped_learnability} labelled otherwise or not labelled (codegym library label)",
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
