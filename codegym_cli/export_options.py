"""`codegym export`: the library's verified task configs as RL training instances.

    codegym export --library lib.db --out train.jsonl --split 0.1     # + train.val.jsonl

Writes CodeGym's training-instance format (JSONL or Parquet), one instance per task config whose
oracle step count (`solve_fc_round`) is within bounds. `--split` holds out whole environments
(chosen by a stable hash of their ids) into `OUT` with `.val` before the suffix. `--learnability`
keeps the task configs a run's served episodes labelled so (`codegym library label`), and
`--difficulty` those a `codegym eval` run solved at a given rate.

Streams: environments are read one at a time and each row is written as it is made (Parquet in
row groups of `ROW_GROUP_ROWS` rows), so memory does not grow with the library (CodeGym's published
one is 80,130 rows over 22,366 environments). In Parquet, `tools` (`--tools json|both`) is each
row's list of OpenAI tool schemas as one JSON string: a Parquet column has one type for all its
rows, and environments' schemas differ. Files are written under a temporary name, renamed when
complete.
"""

from __future__ import annotations

import argparse

from codegym.library.records import TOOL_MODES, learnability_labels
from codegym_cli.later import later


def learnability_argument(text: str) -> frozenset[str]:
    """`--learnability` of export and eval: comma-separated labels."""
    try:
        return learnability_labels(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def register(sub: argparse._SubParsersAction) -> None:
    from codegym.library.location import add_library_argument

    export = sub.add_parser(
        "export",
        help="write the library's verified task configs as training instances (JSONL or Parquet)",
        description=__doc__,
    )
    add_library_argument(export)
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
        "--learnability",
        type=learnability_argument,
        default=None,
        metavar="LABEL[,LABEL...]",
        help="keep only configs labelled so by `codegym library label` (unsolved, learnable, mastered)",
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
    export.set_defaults(func=later("codegym_cli.export", "cmd_export"))
