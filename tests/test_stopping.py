"""A server that stops ends its process, and one that does not stop says where it hangs.

A supervisor (`codegym up`, `codegym pipeline run`, Kubernetes) stops a server with SIGTERM and
waits; a process that drained but never exits looks to it like a server that will not stop, and is
killed with nothing to show why. These run real processes: a server whose interpreter teardown
hangs, a process that ignores SIGTERM, and a running `codegym serve` asked for its stacks.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from codegym import procs
from tests.conftest import ROOT
from tests.helpers.servers import CodegymServer

# A server's main coroutine that leaves a non-daemon thread blocked for good: the interpreter's
# exit joins it, as an exit stuck in a library's teardown would (grpc/grpc#40989).
HANGING_TEARDOWN = """
import sys, threading
from codegym_cli.serve_setup import run_server

def stuck_in_teardown():
    threading.Event().wait()

async def main():
    threading.Thread(target=stuck_in_teardown, name="stuck").start()
    print("served and stopped", flush=True)
    if sys.argv[1] == "raise":
        raise RuntimeError("the server failed")

run_server(main)
"""


@pytest.mark.parametrize(("ending", "code"), [("return", 0), ("raise", 1)])
def test_a_server_whose_teardown_hangs_exits_with_its_outcome_and_names_the_hang(
    ending: str, code: int
) -> None:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", HANGING_TEARDOWN, ending],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,  # without the guard it never exits: this raises
    )
    took = time.monotonic() - started
    assert "served and stopped" in done.stdout
    assert done.returncode == code, done.stderr
    assert "teardown hung" in done.stderr, done.stderr
    assert "stuck_in_teardown" in done.stderr, "the stacks name the blocked thread's function"
    assert took < procs.EXIT_BACKSTOP_S + 20, f"it took {took:.1f} s to exit"


# A process that answers the stacks signal as every `codegym` command does, says it is ready, and
# then ignores SIGTERM inside a function the stacks must name.
IGNORES_SIGTERM = """
import signal, time
from codegym.procs import answer_stacks_signal

def hold_forever():
    while True:
        time.sleep(0.05)

answer_stacks_signal()
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("listening on 127.0.0.1:1", flush=True)
hold_forever()
"""


@pytest.mark.parametrize("stacks", [True, False])
def test_stop_asks_a_process_that_will_not_stop_for_its_stacks_then_kills_it(stacks: bool) -> None:
    server = procs.ServerProcess(
        [sys.executable, "-c", textwrap.dedent(IGNORES_SIGTERM)], cwd=ROOT, stacks=stacks
    )
    assert not server.killed
    assert server.stop(timeout_s=0.5) == -signal.SIGKILL
    assert server.killed
    # Only a process known to answer the signal is sent it (for another it could be fatal).
    assert ("hold_forever" in server.text) is stacks, server.text


def test_a_codegym_server_writes_its_stacks_on_usr1_and_goes_on_serving() -> None:
    server = CodegymServer(["serve", "synthesis", "--port", "0", "--llm-base-url", "http://127.0.0.1:9/v1"])
    try:
        server.proc.send_signal(procs.STACKS_SIGNAL)
        deadline = time.monotonic() + 20
        while "most recent call first" not in server.text:
            assert time.monotonic() < deadline, server.text
            time.sleep(0.05)
        with grpc.insecure_channel(server.address) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        assert server.stop() == 0, server.text[-3000:]
    assert not server.killed
