"""Sessions in a real redis-server: runtime replicas that share them, and what happens when one dies.

Two runtime replicas over two sandbox workers share sessions in Redis; a trainer reaches them with
round_robin. Killing one replica mid-run loses no episode and applies no step twice (a client that
lost a reply sends the step again with its step index); Redis going away gives a clear
UNAVAILABLE, and the stack serves again when it is back.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest

from clients.runtime_client import create_request
from codegym.grpcutil import sync_channel
from codegym.runtime.v1 import runtime_service_pb2 as rt
from codegym.runtime.v1 import runtime_service_pb2_grpc as rt_grpc
from services.runtime.library import Library
from tests.conftest import ENV_DIR, EXAMPLES
from tests.helpers.servers import ServerProcess

TRAJECTORIES = [json.loads(x) for x in (EXAMPLES / "trajectories.jsonl").read_text().splitlines()]
RUNTIME = rt.DESCRIPTOR.services_by_name["RuntimeService"].full_name

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")


class Redis:
    """A redis-server on a free loopback port with an append-only file (so a restart keeps sessions)."""

    def __init__(self, folder: Path, port: int = 0) -> None:
        if not port:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                port = probe.getsockname()[1]
        self.port, self.folder = port, folder
        self.url = f"redis://127.0.0.1:{port}/0"
        self.proc = subprocess.Popen(
            ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--dir", str(folder), "--save", "",
             "--appendonly", "yes", "--appendfsync", "always"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("redis") / "library.db"
    with Library(path) as lib:
        lib.import_paths([ENV_DIR, EXAMPLES / "tasks.jsonl"])
    return path


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[Redis]:
    server = Redis(tmp_path)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def workers() -> Iterator[str]:
    procs = [ServerProcess(["serve", "sandbox", "--port", "0", "--jails", "1"]) for _ in range(2)]
    try:
        yield ",".join(p.address for p in procs)
    finally:
        for proc in procs:
            proc.stop()


def replica(library: Path, workers: str, redis: Redis) -> ServerProcess:
    return ServerProcess(
        ["serve", "runtime", "--port", "0", "--library", str(library), "--sandbox", workers,
         "--sessions", redis.url, "--step-lease-s", "2"]
    )  # fmt: skip


def play(stub: rt_grpc.RuntimeServiceStub, trajectory: dict[str, Any], on_step: Any = None) -> list[str]:
    """One episode; a step whose reply was lost is sent again with its step index."""
    created = stub.CreateSession(
        create_request(env_id=trajectory["env_id"], config=trajectory["config"]),
        timeout=60,
        wait_for_ready=True,
    )
    seen = [created.observation]
    for index, (action, _) in enumerate(trajectory["steps"]):
        if on_step is not None:
            on_step(index)
        request = rt.StepRequest(session_id=created.session_id, action_json=action, step_index=index)
        for attempt in range(20):
            try:
                response = stub.Step(request, timeout=30, wait_for_ready=True)
                break
            except grpc.RpcError as exc:
                if (
                    exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                    or attempt == 19
                ):
                    raise
                time.sleep(0.1)
        assert not response.HasField("error"), response.error
        assert response.step_index == index + 1  # applied once: never twice, never skipped
        seen.append(response.observation)
    assert response.done and response.reward == 1.0
    return seen


def test_a_replica_killed_mid_run_loses_no_episode_and_applies_no_step_twice(
    library: Path, workers: str, redis: Redis
) -> None:
    a, b = replica(library, workers, redis), replica(library, workers, redis)
    episodes = [t for t in TRAJECTORIES if len(t["steps"]) >= 12][:64]
    steps_taken = [0]
    killed = threading.Event()
    lock = threading.Lock()

    def on_step(index: int) -> None:
        with lock:
            steps_taken[0] += 1
            if steps_taken[0] == 300 and not killed.is_set():
                killed.set()
                a.proc.send_signal(signal.SIGKILL)

    try:
        with sync_channel([a.address, b.address], [RUNTIME], no_retry=[(RUNTIME, "Step")]) as channel:
            stub = rt_grpc.RuntimeServiceStub(channel)
            with ThreadPoolExecutor(16) as pool:
                results = list(pool.map(lambda t: play(stub, t, on_step), episodes, timeout=300))
        assert killed.is_set()
        for trajectory, seen in zip(episodes, results, strict=True):
            assert seen == [trajectory["first"], *(o for _, o in trajectory["steps"])]
    finally:
        a.stop()
        b.stop()


def test_a_worker_killed_and_restarted_under_load_loses_no_session(library: Path, redis: Redis) -> None:
    procs = [ServerProcess(["serve", "sandbox", "--port", "0", "--jails", "1"]) for _ in range(2)]
    sandbox = ",".join(p.address for p in procs)
    a, b = replica(library, sandbox, redis), replica(library, sandbox, redis)
    episodes = [t for t in TRAJECTORIES if len(t["steps"]) >= 12][:32]
    steps_taken = [0]
    lock = threading.Lock()
    port = procs[0].address.rsplit(":", 1)[1]

    def restart() -> None:
        time.sleep(1.0)
        procs[0] = ServerProcess(["serve", "sandbox", "--port", port, "--jails", "1"])

    restarter = threading.Thread(target=restart)

    def on_step(index: int) -> None:
        with lock:
            steps_taken[0] += 1
            if steps_taken[0] == 150:
                procs[0].proc.send_signal(signal.SIGKILL)
                restarter.start()

    try:
        with sync_channel([a.address, b.address], [RUNTIME], no_retry=[(RUNTIME, "Step")]) as channel:
            stub = rt_grpc.RuntimeServiceStub(channel)
            with ThreadPoolExecutor(16) as pool:
                results = list(pool.map(lambda t: play(stub, t, on_step), episodes, timeout=300))
        restarter.join(60)
        for trajectory, seen in zip(episodes, results, strict=True):
            assert seen == [trajectory["first"], *(o for _, o in trajectory["steps"])]
        assert procs[0].proc.poll() is None  # the restarted worker is serving again
    finally:
        a.stop()
        b.stop()
        for proc in procs:
            proc.stop()


def test_sigterm_under_load_drains_without_losing_a_step(library: Path, workers: str, redis: Redis) -> None:
    """Every step a client was told succeeded is committed, and every step it was told failed
    (UNAVAILABLE, or CANCELLED for a call that met the server's GOAWAY) was not applied: another
    replica on the same Redis reads exactly the acknowledged step counts."""
    runtime = replica(library, workers, redis)
    episodes = [t for t in TRAJECTORIES if len(t["steps"]) >= 30][:12]
    lock = threading.Lock()
    sent = [0]
    acknowledged: dict[str, int] = {}
    failures: list[str] = []

    def play(trajectory: dict[str, Any]) -> None:
        with grpc.insecure_channel(runtime.address) as channel:
            stub = rt_grpc.RuntimeServiceStub(channel)
            created = stub.CreateSession(
                create_request(env_id=trajectory["env_id"], config=trajectory["config"]), timeout=60
            )
            acknowledged[created.session_id] = 0
            for action, observation in trajectory["steps"]:
                with lock:
                    sent[0] += 1
                    if sent[0] == 120:
                        runtime.proc.send_signal(signal.SIGTERM)
                try:
                    response = stub.Step(
                        rt.StepRequest(session_id=created.session_id, action_json=action), timeout=30
                    )
                except grpc.RpcError as exc:
                    failures.append(exc.code().name)
                    return
                assert response.observation == observation
                acknowledged[created.session_id] += 1

    try:
        with ThreadPoolExecutor(len(episodes)) as pool:
            list(pool.map(play, episodes, timeout=120))
        assert runtime.proc.wait(30) == 0
    finally:
        runtime.stop()
    assert failures and set(failures) <= {"UNAVAILABLE", "CANCELLED"}, failures
    reader = replica(library, workers, redis)
    try:
        with grpc.insecure_channel(reader.address) as channel:
            stub = rt_grpc.RuntimeServiceStub(channel)
            for session_id, count in acknowledged.items():
                stored = stub.GetSession(rt.GetSessionRequest(session_id=session_id), timeout=30)
                assert stored.step_index == count, (session_id, stored.step_index, count)
    finally:
        reader.stop()


def test_redis_going_away_is_unavailable_and_the_stack_recovers(
    library: Path, workers: str, redis: Redis, tmp_path: Path
) -> None:
    runtime = replica(library, workers, redis)
    trajectory = next(t for t in TRAJECTORIES if len(t["steps"]) >= 6)
    try:
        with grpc.insecure_channel(runtime.address) as channel:
            stub = rt_grpc.RuntimeServiceStub(channel)
            created = stub.CreateSession(
                create_request(env_id=trajectory["env_id"], config=trajectory["config"]),
                timeout=60,
            )
            first = stub.Step(
                rt.StepRequest(session_id=created.session_id, action_json=trajectory["steps"][0][0]),
                timeout=30,
            )
            assert first.observation == trajectory["steps"][0][1]
            redis.stop()
            with pytest.raises(grpc.RpcError) as info:
                stub.Step(
                    rt.StepRequest(session_id=created.session_id, action_json=trajectory["steps"][1][0]),
                    timeout=30,
                )
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "Redis" in (info.value.details() or "")
            back = Redis(redis.folder, redis.port)  # same port, same append-only file
            try:
                for index, (action, observation) in enumerate(trajectory["steps"][1:], 1):
                    response = stub.Step(
                        rt.StepRequest(session_id=created.session_id, action_json=action, step_index=index),
                        timeout=30,
                    )
                    assert response.observation == observation and response.step_index == index + 1
                assert response.done and response.reward == 1.0
            finally:
                back.stop()
    finally:
        runtime.stop()


def test_codegym_up_with_two_runtimes_shares_sessions(tmp_path: Path) -> None:
    up = ServerProcess(
        ["up", "--library", str(tmp_path / "lib.db"), "--port", "0", "--jails", "1", "--runtimes", "2"]
    )
    try:
        deadline = time.monotonic() + 30
        while "runtime 2 at" not in up.text and time.monotonic() < deadline:
            time.sleep(0.05)
        addresses = [
            line.split(" at ")[1].split()[0]
            for line in up.text.splitlines()
            if re.match(r"runtime \d+ at ", line)
        ]
        assert len(addresses) == 2 and "redis at redis://" in up.text
        trajectory = next(t for t in TRAJECTORIES if len(t["steps"]) >= 4)
        channels = [grpc.insecure_channel(a) for a in addresses]
        try:
            stubs = [rt_grpc.RuntimeServiceStub(c) for c in channels]
            created = stubs[0].CreateSession(
                create_request(env_id=trajectory["env_id"], config=trajectory["config"]),
                timeout=60,
            )
            for index, (action, observation) in enumerate(trajectory["steps"]):
                # Alternate replicas: each step is served by the other one.
                response = stubs[index % 2].Step(
                    rt.StepRequest(session_id=created.session_id, action_json=action), timeout=30
                )
                assert response.observation == observation
        finally:
            for c in channels:
                c.close()
    finally:
        assert up.stop() == 0
