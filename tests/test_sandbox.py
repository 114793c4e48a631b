"""The sandbox worker against the real nsjail: results, isolation and the adversarial catalogue.

Each hostile request must come back as a clear status, leave the worker healthy, and the very
next request on the same jail (the worker has one) must give the correct answer.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from codegym.sandbox.v1 import sandbox_service_pb2 as pb
from codegym.sandbox.v1 import sandbox_service_pb2_grpc as pb_grpc
from codegym.server.grpcutil import wait_serving
from sandbox_worker.limits import BASE_ID
from tests.conftest import ENV_DIR, PYTHON, ROOT, sample_tasks
from tests.helpers.hostile import hostile
from tests.helpers.processes import (
    assert_all_gone,
    children,
    cmdline,
    count,
    process_tree,
    sleeping_in_jails,
    wait_until,
)
from tests.helpers.servers import CodegymServer, sandbox_workers, worker_fixture
from tests.helpers.trajectories import record

pytestmark = pytest.mark.jail  # every test here starts a sandbox worker

GOOD = (ENV_DIR / "Sample_0001_I__MaxSubarraySumEnv.py").read_text()
GOOD_CONFIG = '{"nums": [-2, 1, -3, 4, -1, 2, 1, -5, 4]}'
FAST = pb.Limits(wall_ms=1500, cpu_ms=1000)

# A secret in the worker's own environment (as an API key would be): nothing in a jail may read it.
SECRET_NAME = "CODEGYM_TEST_SECRET"
SECRET = secrets.token_hex(16)


worker = worker_fixture(add_env={SECRET_NAME: SECRET})


@pytest.fixture(scope="module")
def stub(worker: CodegymServer) -> Iterator[pb_grpc.SandboxServiceStub]:
    with grpc.insecure_channel(worker.address) as channel:
        yield pb_grpc.SandboxServiceStub(channel)


def execute(stub: pb_grpc.SandboxServiceStub, op: pb.Operation) -> pb.OperationResult:
    return stub.Execute(pb.ExecuteRequest(operation=op), timeout=30).result


def create(
    stub: pb_grpc.SandboxServiceStub, source: str, config: str = "{}", **kw: object
) -> pb.OperationResult:
    return execute(
        stub, pb.Operation(source=pb.SourceRef(code=source), create=pb.CreateOp(config_json=config), **kw)
    )


def step(
    stub: pb_grpc.SandboxServiceStub, source: str, state: bytes, action: str, limits: pb.Limits = FAST
) -> pb.OperationResult:
    op = pb.Operation(
        source=pb.SourceRef(code=source), limits=limits, step=pb.StepOp(state=state, action=action)
    )
    return execute(stub, op)


def evil(stub: pb_grpc.SandboxServiceStub, body: str, preamble: str = "") -> pb.OperationResult:
    source = hostile(body, preamble)
    created = create(stub, source)
    assert created.status == pb.STATUS_OK, created.message
    return step(stub, source, created.state, '{"name": "Evil", "parameters": {}}')


def assert_still_correct(stub: pb_grpc.SandboxServiceStub, worker: CodegymServer) -> None:
    wait_serving(worker.address)
    solved = execute(
        stub, pb.Operation(source=pb.SourceRef(code=GOOD), solve=pb.SolveOp(config_json=GOOD_CONFIG))
    )
    assert solved.status == pb.STATUS_OK, solved.message
    assert solved.reward == 1.0 and solved.done
    assert solved.observation == "Your answer: 6, Reference answer: 6, Result: Correct, reward=1"


def test_create_step_and_solve(stub: pb_grpc.SandboxServiceStub) -> None:
    created = create(stub, GOOD, GOOD_CONFIG)
    assert created.status == pb.STATUS_OK
    assert created.observation == "Environment has been reset."
    assert created.env_class == "MaxSubarraySumEnv"
    assert created.source_sha256 == hashlib.sha256(GOOD.encode()).hexdigest()
    stepped = step(stub, GOOD, created.state, '{"name": "GetElement", "parameters": {"index": 3}}')
    assert (stepped.status, stepped.observation, stepped.step_count) == (pb.STATUS_OK, "4", 1)
    again = step(stub, GOOD, stepped.state, '{"name": "Observe", "parameters": {}}')
    assert (again.observation, again.step_count) == ("9", 2)
    done = step(stub, GOOD, again.state, '{"name": "Done", "parameters": {"answer": 6}}')
    assert done.done and done.reward == 1.0
    # The committed state is untouched by later steps: replaying from it gives the same answer.
    assert step(stub, GOOD, stepped.state, '{"name": "Observe", "parameters": {}}').step_count == 2


def test_reset_keeps_or_replaces_the_config(stub: pb_grpc.SandboxServiceStub) -> None:
    created = create(stub, GOOD, '{"nums": [1, 2]}')
    stepped = step(stub, GOOD, created.state, '{"name": "Done", "parameters": {"answer": 3}}')
    assert stepped.done
    reset = execute(stub, pb.Operation(source=pb.SourceRef(code=GOOD), reset=pb.ResetOp(state=stepped.state)))
    assert reset.status == pb.STATUS_OK and not reset.done and reset.step_count == 0
    assert step(stub, GOOD, reset.state, '{"name": "Observe", "parameters": {}}').observation == "2"
    other = execute(
        stub,
        pb.Operation(
            source=pb.SourceRef(code=GOOD), reset=pb.ResetOp(state=stepped.state, config_json='{"nums": [5]}')
        ),
    )
    assert step(stub, GOOD, other.state, '{"name": "Observe", "parameters": {}}').observation == "1"


def test_ref_answer_reports_answer_and_usage(stub: pb_grpc.SandboxServiceStub) -> None:
    result = execute(
        stub, pb.Operation(source=pb.SourceRef(code=GOOD), ref_answer=pb.RefAnswerOp(config_json=GOOD_CONFIG))
    )
    assert result.status == pb.STATUS_OK
    assert (result.answer_json, result.answer_repr) == ("6", "6")
    assert result.usage.peak_rss_kb > 0 and result.usage.wall_ms < 1500


def test_solve_with_a_candidate_and_a_step_cap(stub: pb_grpc.SandboxServiceStub) -> None:
    wrong = "def solve(self):\n    return self.step(json.dumps({'name': 'Done', 'parameters': {'answer': 0}}))[1]\n"
    result = execute(
        stub,
        pb.Operation(
            source=pb.SourceRef(code=GOOD), solve=pb.SolveOp(config_json=GOOD_CONFIG, solve_source=wrong)
        ),
    )
    assert result.status == pb.STATUS_OK and result.reward == 0.0 and result.done and result.step_count == 1
    looping = "def solve(self):\n    while True:\n        self.step(json.dumps({'name': 'Observe', 'parameters': {}}))\n"
    capped = execute(
        stub,
        pb.Operation(
            source=pb.SourceRef(code=GOOD),
            solve=pb.SolveOp(config_json=GOOD_CONFIG, solve_source=looping, max_steps=20),
        ),
    )
    assert capped.status == pb.STATUS_OK and not capped.done and capped.step_count == 20
    assert "exceeded 20 steps" in capped.message


NICENESS = """import os
print(os.nice(0))
try:
    os.nice(-1)
    print("lowered")
except OSError:
    print("refused")
"""


def niceness_inside(stub: pb_grpc.SandboxServiceStub) -> list[str]:
    """What code in a jail sees of its own scheduling priority, and whether it may raise it."""
    result = execute(stub, pb.Operation(source=pb.SourceRef(code=NICENESS), run_script=pb.RunScriptOp()))
    assert result.status == pb.STATUS_OK, result.message
    return result.stdout.split()


def test_jails_share_the_cpu_with_the_worker_unless_told_otherwise(
    stub: pb_grpc.SandboxServiceStub,
) -> None:
    """The same probe in this module's worker (defaults) and in one started with --jail-nice 7:
    the first runs at the worker's own priority (this process's, which the workers inherit; nsjail
    alone would put it at 19, where every step waits for the trusted processes under load), the
    second 7 nicer; neither can lower it."""
    own = os.getpriority(os.PRIO_PROCESS, 0)
    assert niceness_inside(stub) == [str(own), "refused"]
    with sandbox_workers(1, "--jail-nice", "7") as (nicer,), grpc.insecure_channel(nicer.address) as channel:
        assert niceness_inside(pb_grpc.SandboxServiceStub(channel)) == [str(min(19, own + 7)), "refused"]


def test_codegym_up_gives_its_workers_jail_nice(tmp_path: Path) -> None:
    """`codegym up --jail-nice 5`: code in its worker's jails runs 5 nicer than the worker."""
    args = ["up", "--library", str(tmp_path / "lib.db"), "--port", "0", "--workers", "1", "--jails", "1"]
    up = CodegymServer([*args, "--jail-nice", "5", "--no-record"], timeout=120)
    try:
        wait_until(lambda: "Ctrl-C stops everything" in up.text, 60, "codegym up")
        match = re.search(r"sandbox worker 1 at (\S+)", up.text)
        assert match is not None, up.text
        with grpc.insecure_channel(match.group(1)) as channel:
            own = os.getpriority(os.PRIO_PROCESS, 0)
            assert niceness_inside(pb_grpc.SandboxServiceStub(channel)) == [str(min(19, own + 5)), "refused"]
    finally:
        assert up.stop() == 0, up.text[-3000:]


def test_run_script_and_call_function(stub: pb_grpc.SandboxServiceStub) -> None:
    script = execute(stub, pb.Operation(source=pb.SourceRef(code=GOOD), run_script=pb.RunScriptOp()))
    assert script.status == pb.STATUS_OK and script.exit_code == 0
    assert script.stdout.count("reward=1") == 2
    failing = execute(
        stub, pb.Operation(source=pb.SourceRef(code="import sys\nsys.exit(3)\n"), run_script=pb.RunScriptOp())
    )
    assert failing.status == pb.STATUS_ENV_ERROR and failing.exit_code == 3
    solution = "def add(a, b):\n    return (a + b, [a])\n\ndef echo():\n    print(input().upper())\n"
    called = execute(
        stub,
        pb.Operation(
            source=pb.SourceRef(code=solution),
            call_function=pb.CallFunctionOp(function_name="add", args_json="[2, 3]"),
        ),
    )
    assert (
        called.status == pb.STATUS_OK and called.answer_json == "[5,[2]]" and called.answer_repr == "(5, [2])"
    )
    echoed = execute(
        stub,
        pb.Operation(
            source=pb.SourceRef(code=solution),
            call_function=pb.CallFunctionOp(function_name="echo", stdin="hi\n"),
        ),
    )
    assert echoed.stdout == "HI\n"


def test_source_by_hash_and_source_needed(stub: pb_grpc.SandboxServiceStub) -> None:
    fresh = GOOD + "\n# variant for the cache test\n"
    sha = hashlib.sha256(fresh.encode()).hexdigest()
    op = pb.Operation(source=pb.SourceRef(sha256=sha), create=pb.CreateOp(config_json=GOOD_CONFIG))
    assert execute(stub, op).status == pb.STATUS_SOURCE_NEEDED
    assert create(stub, fresh, GOOD_CONFIG).status == pb.STATUS_OK
    assert execute(stub, op).status == pb.STATUS_OK


def test_same_seed_same_result_and_stable_hash_order(stub: pb_grpc.SandboxServiceStub) -> None:
    source = hostile("print(random.random(), {'apple', 'pear', 'fig', 'kiwi'})", preamble="import random")
    created = create(stub, source, seed=7)
    outs = [step(stub, source, created.state, '{"name": "Evil", "parameters": {}}') for _ in range(2)]
    op = pb.Operation(
        source=pb.SourceRef(code=source),
        seed=7,
        step=pb.StepOp(state=created.state, action='{"name": "Evil", "parameters": {}}'),
    )
    seeded = [execute(stub, op).stdout for _ in range(2)]
    assert seeded[0] == seeded[1] and seeded[0]
    assert outs[0].stdout.split(" ", 1)[1] == outs[1].stdout.split(" ", 1)[1]


# --- adversarial catalogue -------------------------------------------------------------------------


def test_infinite_loop_in_a_tool(stub: pb_grpc.SandboxServiceStub, worker: CodegymServer) -> None:
    result = evil(stub, "while True:\n    pass")
    assert result.status == pb.STATUS_TIMEOUT, result.message
    assert_still_correct(stub, worker)


def test_infinite_loop_at_import(stub: pb_grpc.SandboxServiceStub, worker: CodegymServer) -> None:
    result = create(stub, hostile("pass", preamble="while True:\n    pass"), limits=FAST)
    assert result.status == pb.STATUS_TIMEOUT
    assert_still_correct(stub, worker)


def test_sleeping_past_the_wall_clock(stub: pb_grpc.SandboxServiceStub, worker: CodegymServer) -> None:
    result = evil(stub, "import time\ntime.sleep(60)")
    assert result.status == pb.STATUS_TIMEOUT and "wall-clock" in result.message
    assert_still_correct(stub, worker)


@pytest.mark.parametrize(
    "body", ["x = bytearray(8 * 1024 ** 3)", "hog = []\nwhile True:\n    hog.append(' ' * 2 ** 20)"]
)
def test_memory_bomb(stub: pb_grpc.SandboxServiceStub, worker: CodegymServer, body: str) -> None:
    result = evil(stub, body)
    assert result.status == pb.STATUS_MEMORY_LIMIT, result.message
    assert_still_correct(stub, worker)


def test_fork_bomb(stub: pb_grpc.SandboxServiceStub, worker: CodegymServer) -> None:
    result = evil(
        stub, "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    )
    assert result.status in (pb.STATUS_TIMEOUT, pb.STATUS_KILLED), result.message
    assert_still_correct(stub, worker)


def test_deep_recursion(stub: pb_grpc.SandboxServiceStub, worker: CodegymServer) -> None:
    result = evil(stub, "def f(n):\n    return f(n + 1)\nf(0)")
    assert result.status == pb.STATUS_ENV_ERROR and "RecursionError" in result.message
    smashed = evil(
        stub, "import sys\nsys.setrecursionlimit(10 ** 8)\ndef f(n):\n    return f(n + 1) + 1\nf(0)"
    )
    # CPython 3.12 keeps Python frames off the C stack: unbounded recursion ends at a limit, not a segfault.
    assert smashed.status in (pb.STATUS_TIMEOUT, pb.STATUS_MEMORY_LIMIT, pb.STATUS_CRASHED), smashed.message
    assert_still_correct(stub, worker)


def escape_folder(parent: Path) -> Path:
    """A new folder under `parent` that any id may write to (mode 0777): a write from the jail
    that does not land there was stopped by the jail, not by permissions."""
    folder = Path(tempfile.mkdtemp(prefix="codegym-escape-", dir=parent))
    folder.chmod(0o777)
    return folder


def write_marker(marker: Path) -> str:
    """Code that tries to create `marker` with a shell and with open(), and prints what happened."""
    return (
        "import os, subprocess\n"
        f"print('shell', os.system('touch {marker} 2>/dev/null'))\n"
        f"try:\n    open({str(marker)!r}, 'w').write('escaped')\n    print('open ok')\n"
        "except OSError as e:\n    print('open', type(e).__name__)\n"
    )


def test_shell_and_subprocess_see_only_the_jail(
    stub: pb_grpc.SandboxServiceStub, worker: CodegymServer
) -> None:
    # Folders that exist on the host, writable by anyone: under /tmp (the jail has its own) and in
    # the checkout, beside the venv the jail mounts.
    folders = [escape_folder(Path("/tmp")), escape_folder(Path(sys.prefix).parent)]
    try:
        for folder in folders:
            marker = folder / "marker"
            # From outside the jail, as an unprivileged id like the jail's, the same code does
            # leave the marker: its absence below is the jail's doing.
            outside = subprocess.run(
                [PYTHON, "-I", "-c", write_marker(marker)],
                capture_output=True,
                text=True,
                timeout=30,
                user=BASE_ID + 1,
                group=BASE_ID + 1,
                cwd="/",
            )
            assert outside.stdout.split("\n")[:2] == ["shell 0", "open ok"], outside.stdout + outside.stderr
            assert marker.read_text() == "escaped"
            marker.unlink()

            body = write_marker(marker) + (
                "out = subprocess.run(['/bin/cat', '/etc/passwd'], capture_output=True, text=True)\n"
                "print(out.returncode, repr(out.stderr[:200]))"
            )
            result = evil(stub, body)
            assert result.status == pb.STATUS_OK, result.message
            shell, opened, cat = result.stdout.splitlines()
            assert shell != "shell 0" and opened in (
                "open FileNotFoundError",
                "open PermissionError",
                "open OSError",
            )
            assert cat.startswith("1 ") and "No such file" in cat
            assert list(folder.iterdir()) == []
    finally:
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
    assert_still_correct(stub, worker)


def test_writes_outside_tmp_fail_and_tmp_does_not_outlive_a_request(
    stub: pb_grpc.SandboxServiceStub, worker: CodegymServer
) -> None:
    # A file the jail sees through a read-only mount (the venv is mounted wherever it lives, even
    # under /tmp, where the checkout's other files are the jail's own scratch space).
    target = Path(sys.prefix) / "pyvenv.cfg"
    before = target.read_bytes()
    result = evil(
        stub,
        f"try:\n    open({str(target)!r}, 'a').write('pwned')\nexcept OSError as e:\n    print(type(e).__name__)\n"
        "open('/tmp/secret', 'w').write('s3cret')\nprint(open('/tmp/secret').read())",
    )
    assert result.status == pb.STATUS_OK
    assert result.stdout.split()[0] in ("OSError", "FileNotFoundError", "PermissionError")
    assert result.stdout.split()[1] == "s3cret"
    assert target.read_bytes() == before
    leaked = evil(stub, "import os\nprint([e for e in os.listdir('/tmp') if not os.path.isdir('/tmp/' + e)])")
    assert leaked.stdout.strip() == "[]"  # only the folders leading to mounts under /tmp, if any
    assert_still_correct(stub, worker)


def test_host_files_are_invisible(stub: pb_grpc.SandboxServiceStub, worker: CodegymServer) -> None:
    hidden = [
        "/etc/passwd",
        "/etc/shadow",
        "/root/.bash_history",
        str(ROOT / "README.md"),
        str(ROOT / "codegym"),
    ]
    body = (
        "import os\n"
        f"print([p for p in {hidden!r} if os.path.exists(p)])\n"
        "print(sorted(os.listdir('/')))\n"
        "print(os.getuid(), dict(os.environ).get('HOME'), sorted(os.environ))"
    )
    result = evil(stub, body)
    visible, top, ids = result.stdout.splitlines()
    assert visible == "[]"
    assert "etc" not in top and "home" not in top and "var" not in top
    uid, home = ids.split(" ", 2)[:2]
    assert int(uid) > 0 and home == "None"  # an id of its own, never the zygote's (0)
    assert_still_correct(stub, worker)


# Looks for a variable by name in everything it can read: its environment and every
# /proc/PID/environ it can open. Prints what it read and what it found, as JSON.
FIND_SECRET = f"""
import glob, json, os
name = {SECRET_NAME!r}.encode() + b"="
sources = {{"os.environ": "\\0".join(k + "=" + v for k, v in os.environ.items()).encode()}}
for path in ["/proc/self/environ", "/proc/1/environ", "/proc/%d/environ" % os.getppid(),
             *glob.glob("/proc/[0-9]*/environ")]:
    try:
        with open(path, "rb") as f:
            sources[path] = f.read()
    except OSError:
        pass
found = [[where, e.decode()] for where, data in sources.items() for e in data.split(b"\\0") if e.startswith(name)]
print(json.dumps({{"read": sorted(sources), "found": found}}))
"""


def test_the_workers_environment_is_out_of_the_jails_reach(
    stub: pb_grpc.SandboxServiceStub, worker: CodegymServer
) -> None:
    # The worker holds the secret, and the probe finds it from outside the jail (in the worker's
    # /proc/PID/environ), without having it in its own environment.
    assert f"{SECRET_NAME}={SECRET}".encode() in Path(f"/proc/{worker.pid}/environ").read_bytes()
    env = {k: v for k, v in os.environ.items() if k != SECRET_NAME}
    outside = subprocess.run([PYTHON, "-c", FIND_SECRET], capture_output=True, text=True, timeout=30, env=env)
    found_outside = json.loads(outside.stdout)["found"]
    assert [f"/proc/{worker.pid}/environ", f"{SECRET_NAME}={SECRET}"] in found_outside
    # From the jail: nowhere it can read (its own environment; /proc shows it no other process,
    # and its own environ file is not even its: a process whose ids changed is not dumpable).
    result = evil(stub, FIND_SECRET)
    assert result.status == pb.STATUS_OK, result.message
    inside = json.loads(result.stdout)
    assert "os.environ" in inside["read"]
    assert inside["found"] == [] and SECRET not in result.stdout
    assert_still_correct(stub, worker)


WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
]
SET_OF_STRINGS = f"print(str(set({WORDS!r})))"


def test_string_hashing_is_the_same_in_every_jail_and_in_process(
    stub: pb_grpc.SandboxServiceStub,
) -> None:
    """An env that prints a set must show the same text on any jail, on a retry, and in-process."""
    local = subprocess.run(
        [PYTHON, "-c", SET_OF_STRINGS],
        env={"PYTHONHASHSEED": "0", "PATH": os.environ.get("PATH", "")},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    op = pb.Operation(source=pb.SourceRef(code=SET_OF_STRINGS), run_script=pb.RunScriptOp())
    other = CodegymServer(["serve", "sandbox", "--port", "0", "--jails", "1"])
    try:
        with grpc.insecure_channel(other.address) as channel:
            seen = [execute(stub, op).stdout for _ in range(3)]
            seen += [execute(pb_grpc.SandboxServiceStub(channel), op).stdout for _ in range(3)]
    finally:
        assert other.stop() == 0
    assert seen == [local] * 6


def test_network_is_unreachable(stub: pb_grpc.SandboxServiceStub, worker: CodegymServer) -> None:
    port = worker.address.rsplit(":", 1)[1]
    body = (
        "import socket\n"
        "for host in ['127.0.0.1', '1.1.1.1']:\n"
        "    try:\n"
        f"        socket.create_connection((host, {port} if host == '127.0.0.1' else 53), timeout=1)\n"
        "        print(host, 'connected')\n"
        "    except OSError as e:\n"
        "        print(host, type(e).__name__)"
    )
    result = evil(stub, body)
    assert "connected" not in result.stdout
    assert result.stdout.count("Error") == 2, result.stdout
    assert_still_correct(stub, worker)


def test_killing_the_parent_and_everything_else(
    stub: pb_grpc.SandboxServiceStub, worker: CodegymServer
) -> None:
    # The zygote (the parent, pid 1 of the jail) is another id: the kernel refuses the signal.
    result = evil(
        stub,
        "import os, signal\nfor pid in (os.getppid(), 1):\n    try:\n        os.kill(pid, signal.SIGKILL)\n"
        "    except PermissionError:\n        print('refused', pid)",
    )
    assert result.status == pb.STATUS_OK and result.observation == "survived"
    assert result.stdout.split("\n")[:2] == ["refused 1", "refused 1"]
    suicide = evil(stub, "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
    assert suicide.status == pb.STATUS_KILLED and suicide.exit_code == 128 + signal.SIGKILL
    # The request's own grandchild kills everything it may (the request included) and lingers.
    everything = evil(
        stub, "import os, signal, time\nif os.fork() == 0:\n    os.kill(-1, signal.SIGKILL)\ntime.sleep(5)"
    )
    assert everything.status == pb.STATUS_KILLED, everything.message
    worker_pid = evil(stub, f"import os, signal\nos.kill({worker.pid}, signal.SIGKILL)")
    assert worker_pid.status == pb.STATUS_ENV_ERROR and "ProcessLookupError" in worker_pid.message
    assert worker.proc.poll() is None
    assert_still_correct(stub, worker)


def test_huge_output(stub: pb_grpc.SandboxServiceStub, worker: CodegymServer) -> None:
    result = evil(stub, "while True:\n    print('spam' * 1000)")
    assert result.status == pb.STATUS_OUTPUT_LIMIT
    assert result.output_truncated and 0 < len(result.stdout) <= 64 * 1024
    assert_still_correct(stub, worker)


def test_monkeypatching_does_not_reach_the_next_request(
    stub: pb_grpc.SandboxServiceStub, worker: CodegymServer
) -> None:
    result = evil(
        stub, "import builtins, json\nbuiltins.len = lambda x: 42\njson.dumps = lambda *a, **k: 'HACKED'"
    )
    assert result.status == pb.STATUS_OK
    check = evil(stub, "import json\nprint(len([1]), json.dumps([1]))")
    assert check.stdout.strip() == "1 [1]"
    assert_still_correct(stub, worker)


def test_malformed_action_and_unknown_tool_are_env_data(stub: pb_grpc.SandboxServiceStub) -> None:
    created = create(stub, GOOD, GOOD_CONFIG)
    bad_json = step(stub, GOOD, created.state, "{not json")
    assert bad_json.status == pb.STATUS_OK and bad_json.observation.startswith("Error:")
    unknown = step(stub, GOOD, created.state, '{"name": "Teleport", "parameters": {}}')
    assert unknown.observation == "Error: Invalid action: Teleport"


def test_state_from_another_environment(stub: pb_grpc.SandboxServiceStub, worker: CodegymServer) -> None:
    other_source = (ENV_DIR / "Sample_0006_I__ArrayGcdEnv.py").read_text()
    foreign = create(stub, other_source, '{"nums": [4, 6]}').state
    result = step(stub, GOOD, foreign, '{"name": "Observe", "parameters": {}}')
    assert result.status == pb.STATUS_BAD_REQUEST and "another environment" in result.message
    garbage = step(stub, GOOD, b"\x00garbage", '{"name": "Observe", "parameters": {}}')
    assert garbage.status == pb.STATUS_BAD_REQUEST
    assert_still_correct(stub, worker)


def test_invalid_sources(stub: pb_grpc.SandboxServiceStub, worker: CodegymServer) -> None:
    syntax = create(stub, "class Broken(:\n")
    assert syntax.status == pb.STATUS_BAD_REQUEST and "does not compile" in syntax.message
    no_env = create(stub, "x = 1\n")
    assert no_env.status == pb.STATUS_BAD_REQUEST and "gymnasium.Env" in no_env.message
    raising = create(stub, "raise ValueError('boom at import')\n")
    assert raising.status == pb.STATUS_ENV_ERROR and "boom at import" in raising.message
    bad_config = create(stub, GOOD, "[1, 2]")
    assert bad_config.status == pb.STATUS_BAD_REQUEST and "must be an object" in bad_config.message
    assert_still_correct(stub, worker)


def test_bad_requests_are_rpc_errors(stub: pb_grpc.SandboxServiceStub) -> None:
    with pytest.raises(grpc.RpcError) as no_kind:
        stub.Execute(pb.ExecuteRequest(operation=pb.Operation(source=pb.SourceRef(code=GOOD))), timeout=10)
    assert no_kind.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as no_source:
        stub.Execute(pb.ExecuteRequest(operation=pb.Operation(create=pb.CreateOp())), timeout=10)
    assert no_source.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as oversized:
        stub.Execute(
            pb.ExecuteRequest(operation=pb.Operation(source=pb.SourceRef(code="#" * (17 << 20)))), timeout=10
        )
    assert oversized.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_batch_returns_results_in_order(stub: pb_grpc.SandboxServiceStub) -> None:
    configs = [{"nums": [i, -1, i]} for i in range(1, 9)]
    ops = [
        pb.Operation(source=pb.SourceRef(code=GOOD), ref_answer=pb.RefAnswerOp(config_json=json.dumps(c)))
        for c in configs
    ]
    ops.insert(
        3,
        pb.Operation(
            source=pb.SourceRef(code=hostile("pass", preamble="raise SystemExit(4)")), create=pb.CreateOp()
        ),
    )
    results = stub.ExecuteBatch(pb.ExecuteBatchRequest(operations=ops, max_parallel=4), timeout=60).results
    assert [r.answer_json for r in results[:3] + results[4:]] == [str(2 * i - 1) for i in range(1, 9)]
    assert results[3].status == pb.STATUS_ENV_ERROR


def test_a_dead_jail_is_replaced(stub: pb_grpc.SandboxServiceStub, worker: CodegymServer) -> None:
    before = stub.GetWorkerInfo(pb.GetWorkerInfoRequest(), timeout=10)
    pids = [pid for pid in children(worker.pid) if "nsjail" in (cmdline(pid) or "")]
    assert len(pids) == 1, "the worker has not its one nsjail child"
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 20
    result = None
    while time.monotonic() < deadline:
        result = create(stub, GOOD, GOOD_CONFIG)
        if result.status == pb.STATUS_OK:
            break
        assert result.status == pb.STATUS_CRASHED
        time.sleep(0.2)
    assert result is not None and result.status == pb.STATUS_OK
    after = stub.GetWorkerInfo(pb.GetWorkerInfoRequest(), timeout=10)
    assert after.jails_replaced == before.jails_replaced + 1 and after.jails_alive == 1
    assert_still_correct(stub, worker)


def test_sample_envs_through_the_worker_match_in_process(stub: pb_grpc.SandboxServiceStub) -> None:
    tasks = [t for t in sample_tasks() if t["difficulty"] == "easy"]
    jobs = [
        {
            "path": str(ENV_DIR / f"{t['env_id']}.py"),
            "class": t["env_id"].split("__")[1],
            "config": t["config"],
        }
        for t in tasks
    ]
    recorded = record(jobs)
    for task, trajectory in zip(tasks, recorded, strict=True):
        source = (ENV_DIR / f"{task['env_id']}.py").read_text()
        created = create(stub, source, json.dumps(task["config"]))
        assert created.observation == trajectory["first"]
        state = created.state
        for action, observation in trajectory["steps"]:
            result = step(stub, source, state, action)
            assert result.status == pb.STATUS_OK and result.observation == observation, (
                task["env_id"],
                action,
            )
            state = result.state
        assert result.reward == trajectory["reward"] == 1.0 and result.done


def test_sigterm_drains_and_exits_cleanly() -> None:
    server = CodegymServer(["serve", "sandbox", "--port", "0", "--jails", "2"])
    wait_serving(server.address, "codegym.sandbox.v1.SandboxService")
    # The worker's whole tree, its jails' processes included (each zygote and its spare fork).
    tree = process_tree(server.pid)
    assert count(tree, "nsjail") == 2 and count(tree, "/sandbox/zygote.py") >= 4, tree
    assert server.stop(signal.SIGTERM) == 0
    assert_all_gone(tree)


def _sleeper(seconds: float) -> pb.ExecuteRequest:
    source = f"import time\ntime.sleep({seconds})\n"
    return pb.ExecuteRequest(
        operation=pb.Operation(
            source=pb.SourceRef(code=source),
            run_script=pb.RunScriptOp(),
            limits=pb.Limits(wall_ms=int(seconds * 1000) + 5000),
        )
    )


def serving(channel: grpc.Channel) -> bool:
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
    except grpc.RpcError:
        return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def test_overload_is_resource_exhausted_and_loses_nothing() -> None:
    server = CodegymServer(["serve", "sandbox", "--port", "0", "--jails", "2", "--max-pending", "2"])
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.SandboxServiceStub(channel)
            futures = [stub.Execute.future(_sleeper(2.0), timeout=30) for _ in range(2)]
            # The worker holds both: each one sleeps in a jail.
            wait_until(lambda: len(sleeping_in_jails(server.pid)) == 2, 20, "both requests to run")
            with pytest.raises(grpc.RpcError) as refused:
                stub.Execute(_sleeper(0.1), timeout=30)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "retry later" in refused.value.details()
            assert [f.result().result.status for f in futures] == [pb.STATUS_OK, pb.STATUS_OK]
    finally:
        assert server.stop() == 0


def test_drain_finishes_running_work_and_refuses_new_work() -> None:
    server = CodegymServer(["serve", "sandbox", "--port", "0", "--jails", "1"])
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.SandboxServiceStub(channel)
        # Long enough to still run after the checks below on a loaded machine, within the 5 s grace.
        running = stub.Execute.future(_sleeper(4.0), timeout=30)
        wait_until(lambda: bool(sleeping_in_jails(server.pid)), 20, "the request to start")
        server.proc.send_signal(signal.SIGTERM)
        # Draining: the worker no longer answers SERVING (its refusals start before that).
        wait_until(lambda: not serving(channel), 10, "the worker to leave SERVING")
        with pytest.raises(grpc.RpcError) as refused:
            stub.Execute(_sleeper(0.1), timeout=10, wait_for_ready=False)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert not running.done()
        assert running.result().result.status == pb.STATUS_OK
    assert server.proc.wait(20) == 0
