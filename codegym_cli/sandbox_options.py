"""`codegym sandbox run`: one operation on one file, printed as JSON."""

from __future__ import annotations

import argparse

from codegym_cli.later import later

OPS = ("create", "solve", "ref_answer", "script", "call_function")


def register(sub: argparse._SubParsersAction) -> None:
    sandbox = sub.add_parser("sandbox", help="run untrusted code through a sandbox worker")
    sandbox_sub = sandbox.add_subparsers(dest="sandbox_command", required=True, metavar="COMMAND")
    run = sandbox_sub.add_parser(
        "run",
        help="run one operation on a file and print the result as JSON (exit 0 when status is OK)",
    )
    run.add_argument("file", help="environment (or solution) source file")
    run.add_argument("--op", choices=OPS, default="solve", help="operation")
    run.add_argument("--config", default="{}", help="task config JSON (create, solve, ref_answer)")
    run.add_argument("--function", default="", help="function name (call_function)")
    run.add_argument("--args", default="[]", help="JSON array of arguments (call_function)")
    run.add_argument("--stdin", default="", help="text fed to stdin (script, call_function)")
    run.add_argument("--seed", type=int, default=0, help="seed for random")
    run.add_argument("--target", default="", help="HOST:PORT of a worker; empty starts one in-process")
    run.add_argument("--timeout", type=float, default=60.0, help="RPC deadline in seconds")
    run.add_argument("--show-state", action="store_true", help="include the opaque state (base64)")
    run.set_defaults(func=later("codegym_cli.sandbox", "cmd_run"))
