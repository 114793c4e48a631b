"""`codegym sandbox run`: one operation on one file, printed as JSON."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from codegym.sandbox.v1 import sandbox_service_pb2 as pb
from codegym.sandbox.v1 import sandbox_service_pb2_grpc as pb_grpc
from codegym_cli.access import client_access
from codegym_client.channels import aio_channel


def build_operation(
    source: str, op: str, config: str, *, function: str = "", args: str = "[]", stdin: str = "", seed: int = 0
) -> pb.Operation:
    operation = pb.Operation(source=pb.SourceRef(code=source), seed=seed)
    if op == "create":
        operation.create.config_json = config
    elif op == "solve":
        operation.solve.config_json = config
    elif op == "ref_answer":
        operation.ref_answer.config_json = config
    elif op == "script":
        operation.run_script.stdin = stdin
    elif op == "call_function":
        operation.call_function.function_name = function
        operation.call_function.args_json = args
        operation.call_function.stdin = stdin
    return operation


async def _run(args: argparse.Namespace, operation: pb.Operation) -> pb.OperationResult:
    from sandbox_worker.server import worker_target

    async with (
        worker_target(args.target, jails=1) as target,
        aio_channel(target, ["codegym.sandbox.v1.SandboxService"], access=client_access(args)) as channel,
    ):
        stub = pb_grpc.SandboxServiceStub(channel)
        response = await stub.Execute(pb.ExecuteRequest(operation=operation), timeout=args.timeout)
        return response.result


def numbers_as_numbers(message: Message, data: dict[str, Any]) -> dict[str, Any]:
    """Proto JSON writes 64-bit integers as strings; a user reading `peak_rss_kb` wants a number."""
    wide = (FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64)
    for field in message.DESCRIPTOR.fields:
        if field.name not in data:
            continue
        value = data[field.name]
        if isinstance(value, list):  # repeated fields here hold strings only
            continue
        if field.type in wide:
            data[field.name] = int(value)
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            numbers_as_numbers(getattr(message, field.name), value)
    return data


def cmd_run(args: argparse.Namespace) -> int:
    try:
        source = Path(args.file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        print(f"codegym: cannot read {args.file}: {exc}", file=sys.stderr)
        return 2
    operation = build_operation(
        source, args.op, args.config, function=args.function, args=args.args, stdin=args.stdin, seed=args.seed
    )
    result = asyncio.run(_run(args, operation))
    out = numbers_as_numbers(result, json_format.MessageToDict(result, preserving_proto_field_name=True))
    if not args.show_state:
        out.pop("state", None)
    print(json.dumps(out, indent=2, ensure_ascii=False))
    return 0 if result.status == pb.STATUS_OK else 1
