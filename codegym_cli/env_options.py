"""`codegym env ...`: static inspection of environment sources (never runs them)."""

from __future__ import annotations

import argparse

from codegym_cli.later import later


def register(sub: argparse._SubParsersAction) -> None:
    env = sub.add_parser("env", help="inspect environment sources statically")
    env_sub = env.add_subparsers(dest="env_command", required=True, metavar="COMMAND")
    describe = env_sub.add_parser("describe", help="print the agent-facing tool list of an environment file")
    describe.add_argument("file", help="environment source file")
    describe.add_argument(
        "--format",
        choices=("text", "json"),
        default="text",
        help="text: CodeGym's system-prompt form; json: OpenAI tool definitions",
    )
    describe.set_defaults(func=later("codegym_cli.env", "cmd_describe"))
    check = env_sub.add_parser(
        "check",
        help="check the environment contract and scan for risky constructs; "
        "exit 0 when the contract is met, 1 otherwise",
    )
    check.add_argument("file", help="environment source file")
    check.add_argument("--format", choices=("text", "json"), default="text", help="report format")
    check.set_defaults(func=later("codegym_cli.env", "cmd_check"))
