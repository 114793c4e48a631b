"""The `codegym` command line. Each command group lives in its own module and registers here."""

from __future__ import annotations

import os

# gRPC core prints its own lines (e.g. "E1126 ... add_port.cc:83 Failed to add port") next to the
# one-line errors this command line gives; keep them for those who ask with GRPC_VERBOSITY.
os.environ.setdefault("GRPC_VERBOSITY", "NONE")

import argparse
import sys

from clients import (
    demo_command,
    env_commands,
    export_command,
    library_commands,
    pipeline_command,
    sandbox_commands,
    serve_commands,
    synthesize_command,
    up_command,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="codegym",
        description="CodeGym service: interactive, verified tool-use environments for RL training of agents.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    env_commands.register(sub)
    library_commands.register(sub)
    sandbox_commands.register(sub)
    serve_commands.register(sub)
    up_command.register(sub)
    demo_command.register(sub)
    synthesize_command.register(sub)
    pipeline_command.register(sub)
    export_command.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from sandbox_worker.jail import JailDied

    args = build_parser().parse_args(argv)
    try:
        result: int = args.func(args)
        sys.stdout.flush()  # inside the try: a reader gone early shows up here, not at exit
    except BrokenPipeError:
        # The reader went away (`codegym library list | head`): stop quietly, as Unix tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (OSError, JailDied) as exc:
        # Ports in use, unreadable files, jails that cannot start: what failed, without a traceback.
        print(f"codegym: {exc}", file=sys.stderr)
        return 1
    return result


if __name__ == "__main__":
    sys.exit(main())
