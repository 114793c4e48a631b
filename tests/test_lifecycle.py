"""Children die with their parent: SIGKILL of `codegym up` or `codegym pipeline run` leaves nothing.

A SIGKILL runs no cleanup code, so only the kernel can end what the killed command started. Each
test takes the killed command's whole process tree before the kill (following the parent links
in /proc, so the workers' nsjail processes, the zygotes and the session processes inside the
jails, which show up there with host pids, are in it) and the ports that tree listens on; after
the kill every one of those processes must be gone and every port free, within a few seconds.
The command runs under a small subreaper process (PR_SET_CHILD_SUBREAPER), so a process it
started *after* the snapshot and that outlived it would be reparented there and seen too.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from codegym import procs
from codegym.sandbox.v1 import sandbox_service_pb2 as pb
from codegym.sandbox.v1 import sandbox_service_pb2_grpc as pb_grpc
from codegym_client.api.runtime.v1 import runtime_service_pb2 as rt
from codegym_client.api.runtime.v1 import runtime_service_pb2_grpc as rt_grpc
from codegym_testkit.fake_llm import ScriptedLLM
from tests.conftest import ROOT, SAMPLES
from tests.helpers.pipeline_cases import case_problem, case_script, write_problems
from tests.helpers.processes import (
    Proc,
    comm,
    count,
    identity,
    listening_ports,
    port_free,
    process_tree,
    running,
    stat_fields,
    wait_for,
)
from tests.helpers.servers import require_redis_server


@pytest.fixture
def reaper() -> Iterator[list[Proc]]:
    """Processes a failed test leaves are killed by pid (and start time), so the next test starts clean."""
    seen: list[Proc] = []
    yield seen
    for proc in seen:
        if running(proc):
            os.kill(proc[0], signal.SIGKILL)


# Runs ARGV as its child with stdout inherited, after one line naming that child's pid; as a
# subreaper it adopts whatever the child leaves behind. It reaps nothing, so only zombies (counted
# as gone) stay its children once they are dead.
SUBREAPER = """
import ctypes, signal, subprocess, sys
if ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER
    sys.exit("prctl(PR_SET_CHILD_SUBREAPER) failed")
command = subprocess.Popen(sys.argv[1:])
print(f"command pid {command.pid}", flush=True)
while True:
    signal.pause()
"""


def under_subreaper(argv: list[str]) -> list[str]:
    return [sys.executable, "-c", SUBREAPER, *argv]


def command_pid(line: str) -> int:
    match = re.search(r"^command pid (\d+)$", line, re.MULTILINE)
    assert match, line
    return int(match.group(1))


def kill_and_check(target: int, tree: dict[Proc, str], subreaper: int, reaper: list[Proc]) -> None:
    """SIGKILL `target`; within 10 s every process of `tree` (its tree before the kill) is gone,
    nothing was adopted by the subreaper, and every port the tree listened on is free."""
    reaper.extend(tree)
    ports = listening_ports({pid for pid, _ in tree})
    assert ports, "the tree listens on no port: the test would prove nothing about ports"

    def adopted() -> list[Proc]:
        return [p for p in process_tree(subreaper) if p[0] not in (subreaper, target) and running(p)]

    os.kill(target, signal.SIGKILL)
    wait_for(lambda: not any(running(p) for p in tree) and not adopted(), 10)
    left = {pid: cmdline[:100] for (pid, start), cmdline in tree.items() if running((pid, start))}
    reaper.extend(adopted())
    assert left == {}, f"{len(left)} of {len(tree)} processes outlived their killed parent"
    assert adopted() == [], "processes started after the snapshot outlived their killed parent"
    wait_for(lambda: all(port_free(p) for p in ports), 5)
    assert sorted(p for p in ports if not port_free(p)) == []


@pytest.mark.jail
def test_sigkill_of_codegym_up_leaves_no_process_and_no_port(tmp_path: Path, reaper: list[Proc]) -> None:
    require_redis_server()  # --runtimes 2 shares sessions in a private redis-server
    args = [
        "up",
        "--library",
        str(tmp_path / "lib.db"),
        "--port",
        "0",
        "--workers",
        "2",
        "--jails",
        "2",
        "--runtimes",
        "2",
    ]
    wrapper = procs.ServerProcess(under_subreaper(procs.codegym_command(args)), name="codegym up")
    try:
        up = identity(command_pid(wrapper.text))
        reaper.append(up)
        assert wait_for(lambda: "Ctrl-C stops everything" in wrapper.text, 60), wrapper.text
        # A live session, so the jails hold a session process besides their zygote and its spare.
        trajectory = json.loads((SAMPLES / "trajectories.jsonl").read_text().splitlines()[0])
        with grpc.insecure_channel(wrapper.address) as channel:
            config = trajectory["config"]
            task = rt.EnvTask(
                env_id=trajectory["env_id"],
                config_json=config if isinstance(config, str) else json.dumps(config),
            )
            created = rt_grpc.RuntimeServiceStub(channel).CreateSession(
                rt.CreateSessionRequest(env_task=task), timeout=60, wait_for_ready=True
            )
            assert created.observation == trajectory["first"]
        tree = process_tree(up[0])
        # Everything `codegym up --runtimes 2` runs is in the tree the test watches.
        assert count(tree, "serve sandbox") == 2 and count(tree, "serve runtime") == 2, tree
        assert count(tree, "redis-server") == 1 and count(tree, "nsjail") == 4, tree
        assert count(tree, "zygote.py") >= 5, tree  # 4 zygotes + at least the session's process
        kill_and_check(up[0], tree, wrapper.pid, reaper)
    finally:
        wrapper.stop(signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.jail
def test_sigkill_of_pipeline_run_mid_run_leaves_no_process_and_no_port(
    tmp_path: Path, reaper: list[Proc]
) -> None:
    problems = tmp_path / "problems.jsonl"
    write_problems(problems, [case_problem("slow")])
    work = tmp_path / "work"
    with ScriptedLLM(case_script) as llm:
        args = [
            "pipeline",
            "run",
            "--problems",
            str(problems),
            "--work",
            str(work),
            "--llm-base-url",
            llm.base_url,
            "--model",
            "scripted",
            "--workers",
            "2",
            "--jails",
            "1",
        ]
        wrapper = procs.popen(
            under_subreaper(procs.codegym_command(args)),
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            cwd=ROOT,
        )
        try:
            assert wrapper.stdout is not None
            run = identity(command_pid(wrapper.stdout.readline()))
            reaper.append(run)

            def solving() -> bool:
                """The solve() candidates run in the jails: the run is in its solvability stage."""
                if not running(run):
                    return True
                try:  # read-only: never create the file before the run does
                    with sqlite3.connect(f"file:{work / 'pipeline.db'}?mode=ro", uri=True) as db:
                        rows = db.execute("SELECT stage, status FROM stages").fetchall()
                except sqlite3.Error:
                    return False
                return ("solve_functions", "passed") in rows

            assert wait_for(solving, 300) and running(run), "the run ended before it could be killed"
            tree = process_tree(run[0])
            assert count(tree, "serve sandbox") == 2 and count(tree, "serve verification") == 1, tree
            assert count(tree, "serve synthesis") == 1 and count(tree, "nsjail") == 2, tree
            kill_and_check(run[0], tree, wrapper.pid, reaper)
        finally:
            wrapper.kill()
            wrapper.wait(30)
            assert wrapper.stdout is not None
            wrapper.stdout.close()


# A script that names its process (so the test sees it run) and then outsleeps the test.
SLEEPER = "import ctypes, time\nctypes.CDLL(None).prctl(15, b'lifecycle-sleep', 0, 0, 0)\ntime.sleep(120)\n"


@pytest.mark.jail
def test_sigkill_of_a_sandbox_worker_mid_request_ends_its_jail_at_once(reaper: list[Proc]) -> None:
    """A zygote busy with a request reads no input, so it would notice its worker's death only when
    the request ends (up to the 60 s wall limit): the jail must die with the worker, not then."""
    argv = procs.codegym_command(["serve", "sandbox", "--port", "0", "--jails", "1"])
    wrapper = procs.ServerProcess(under_subreaper(argv), name="sandbox worker")
    try:
        worker = identity(command_pid(wrapper.text))
        reaper.append(worker)
        with grpc.insecure_channel(wrapper.address) as channel:
            operation = pb.Operation(
                source=pb.SourceRef(code=SLEEPER),
                run_script=pb.RunScriptOp(),
                limits=pb.Limits(wall_ms=60_000, cpu_ms=60_000),
            )
            call = pb_grpc.SandboxServiceStub(channel).Execute.future(
                pb.ExecuteRequest(operation=operation), timeout=90
            )

            def sleeping() -> bool:
                return any(comm(pid) == "lifecycle-sleep" for pid, _ in process_tree(worker[0]))

            assert wait_for(sleeping, 30), "the script never ran in the jail"
            tree = process_tree(worker[0])
            assert count(tree, "nsjail") == 1 and count(tree, "zygote.py") >= 2, tree
            kill_and_check(worker[0], tree, wrapper.pid, reaper)
            call.cancel()
    finally:
        wrapper.stop(signal.SIGKILL)


CHILD_OF_A_THREAD = """
import os, sys, threading, time
from codegym import procs

children = []
thread = threading.Thread(target=lambda: children.append(procs.popen(["sleep", "300"])))
thread.start()
tid = thread.native_id
thread.join()
deadline = time.monotonic() + 10
while os.path.exists(f"/proc/self/task/{tid}") and time.monotonic() < deadline:
    time.sleep(0.01)
print(children[0].pid, flush=True)
sys.stdin.read()
"""


def test_a_child_started_from_a_short_lived_thread_outlives_the_thread_not_the_process(
    reaper: list[Proc],
) -> None:
    """PR_SET_PDEATHSIG fires when the forking *thread* exits: `popen` forks from a long-lived one."""
    parent = subprocess.Popen(
        [sys.executable, "-c", CHILD_OF_A_THREAD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        child_proc = (child, int((stat_fields(child) or [""] * 20)[19]))
        reaper.append(child_proc)
        # The thread that asked for it is gone (its OS thread too): the child must still run.
        assert not wait_for(lambda: not running(child_proc), 1.0)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        assert wait_for(lambda: not running(child_proc), 10)
    finally:
        if parent.poll() is None:
            parent.kill()
        parent.wait(10)
