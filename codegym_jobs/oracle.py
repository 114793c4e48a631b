"""Oracle trajectories: each task played by its environment's own `solve()`, inside a sandbox.

The runtime never sees an environment's solution; a demo or a benchmark that wants to replay
good episodes reads them from a JSONL file this module writes. Every line holds the env id, the
config, the first observation, the (action, observation) pairs and the final reward.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from codegym.library.store import EnvRecord
from codegym.sandbox.v1 import sandbox_service_pb2 as pb
from codegym.sandbox.v1 import sandbox_service_pb2_grpc as pb_grpc
from codegym_client.channels import Access, aio_channel

SANDBOX = pb.DESCRIPTOR.services_by_name["SandboxService"].full_name


async def record_oracle(
    envs: Iterable[EnvRecord],
    target: str = "",
    *,
    max_steps: int = 256,
    timeout_s: float = 300.0,
    access: Access | None = None,
) -> list[dict[str, Any]]:
    """Run solve() with recording for every task of `envs`; `target` empty starts a local worker.
    `access`: how `target` is called (a local worker takes no token)."""
    from sandbox_worker.server import worker_target

    trajectories: list[dict[str, Any]] = []
    async with (
        worker_target(target, jails=2) as address,
        aio_channel(address, [SANDBOX], access=access) as channel,
    ):
        stub = pb_grpc.SandboxServiceStub(channel)
        for record in envs:
            if not record.tasks:
                continue
            ops = [
                pb.Operation(
                    source=pb.SourceRef(code=record.source),
                    limits=pb.Limits(wall_ms=20_000, cpu_ms=20_000),
                    solve=pb.SolveOp(config_json=task.config_json, max_steps=max_steps, record=True),
                )
                for task in record.tasks
            ]
            response = await stub.ExecuteBatch(pb.ExecuteBatchRequest(operations=ops), timeout=timeout_s)
            for task, result in zip(record.tasks, response.results, strict=True):
                line: dict[str, Any] = {
                    "env_id": record.env_id,
                    "config": json.loads(task.config_json),
                    "difficulty": task.difficulty,
                    "status": pb.Status.Name(result.status).removeprefix("STATUS_").lower(),
                    "reward": result.reward,
                }
                if result.status == pb.STATUS_OK and result.trajectory:
                    items = list(result.trajectory)
                    line["first"] = items[0]
                    line["steps"] = [[items[i], items[i + 1]] for i in range(1, len(items) - 1, 2)]
                else:
                    line["message"] = result.message
                trajectories.append(line)
    return trajectories


def write_trajectories(path: str | Path, trajectories: Iterable[dict[str, Any]]) -> None:
    with open(path, "w", encoding="utf-8") as out:
        for line in trajectories:
            out.write(json.dumps(line, ensure_ascii=False) + "\n")


def read_trajectories(path: str | Path) -> list[dict[str, Any]]:
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]
