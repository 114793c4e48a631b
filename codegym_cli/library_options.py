"""`codegym library import|list|show|oracle`: build and inspect an environment library (SQLite).

The options; what the commands do is in library.py. `replay` lives in library_replay.py;
`stats|sample|quarantine|label`, which read the runtime's record of served episodes, in
library_curriculum.py (each with its `_options` module)."""

from __future__ import annotations

import argparse

from codegym.library.location import add_library_argument
from codegym.library.records import ON_CONFLICT
from codegym_cli import library_curriculum_options, library_replay_options
from codegym_cli.later import later


def register(sub: argparse._SubParsersAction) -> None:
    library = sub.add_parser("library", help="build and inspect an environment library (SQLite)")
    lib_sub = library.add_subparsers(dest="library_command", required=True, metavar="ACTION")

    def common(p: argparse.ArgumentParser) -> None:
        add_library_argument(p)

    imp = lib_sub.add_parser(
        "import",
        help="import everything CodeGym publishes: its Hugging Face dataset's Parquet, its pipeline's "
        "outputs, env files, task and training-instance JSONL",
        description="Reads, by content: environment tables (Parquet with env_code, env_name, source), "
        "training-instance rows (Parquet or JSON lines with ability), verified environments (JSON with "
        "gym_env, unit_test_list), {code_id}__{Env}.py env files and task lines (env_id, config), in "
        "files or folders (a Hugging Face snapshot as downloaded). Every source is compiled and checked "
        "statically, nothing is run; an environment key whose code differs from the library's is a "
        "conflict (refused unless --on-conflict says otherwise); a task recorded with other code than "
        "its environment's keeps its own. Commits a batch at a time: re-running adds what is missing "
        "and reports the rest present. Prints what each source's rows became; exit 1 when conflicts "
        "were refused, nothing usable was read, or (--strict) anything was skipped.",
    )
    imp.add_argument("paths", nargs="+", help="files or folders")
    imp.add_argument(
        "--on-conflict",
        choices=ON_CONFLICT,
        default="refuse",
        help="an environment key met with other code than the library's: refuse it (exit 1), keep the "
        "library's code, or replace it (tasks recorded with the old code keep it)",
    )
    imp.add_argument("--strict", action="store_true", help="exit 1 when anything was skipped")
    imp.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    imp.add_argument("--report", metavar="FILE", help="also write the report as JSON to FILE")
    imp.add_argument(
        "--quiet", action="store_true", help="no progress bar (there is none when stderr is not a terminal)"
    )
    imp.add_argument("--jobs", type=int, default=0, help="processes checking sources (0: one per core)")
    common(imp)
    imp.set_defaults(func=later("codegym_cli.library", "_import"))

    ls = lib_sub.add_parser("list", help="environments with their task counts and tools")
    ls.add_argument("--prefix", default="", help="only env ids starting with this")
    ls.add_argument("--json", action="store_true", help="one JSON object per line")
    common(ls)
    ls.set_defaults(func=later("codegym_cli.library", "_list"))

    show = lib_sub.add_parser("show", help="one environment: task text, tools, task configs")
    show.add_argument("env_id")
    show.add_argument("--tasks", type=int, default=20, help="task configs to print")
    show.add_argument("--json", action="store_true", help="print JSON")
    common(show)
    show.set_defaults(func=later("codegym_cli.library", "_show"))

    oracle = lib_sub.add_parser(
        "oracle",
        help="play every task with its env's own solve() in a sandbox; write the trajectories as JSONL",
        description="Records solve_fc_round (the oracle's step count) in the library too.",
    )
    oracle.add_argument("--out", required=True, help="trajectory JSONL to write")
    oracle.add_argument("--prefix", default="", help="only env ids starting with this")
    oracle.add_argument("--sandbox", default="", help="HOST:PORT of a sandbox worker; empty starts one")
    common(oracle)
    oracle.set_defaults(func=later("codegym_cli.library", "_oracle"))
    library_replay_options.add_parser(lib_sub)
    library_curriculum_options.add_parsers(lib_sub)
