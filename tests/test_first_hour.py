"""What a new user meets first: a checkout anywhere works, failures are one true line, no noise.

Each test runs the command line as a user would (a real process) and checks the exit code and
the line the user sees.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from codegym.sandbox.v1 import sandbox_service_pb2 as pb
from codegym.sandbox.v1 import sandbox_service_pb2_grpc as pb_grpc
from tests.conftest import ENV_DIR, ROOT, SAMPLES
from tests.helpers.servers import CodegymServer


def tmp_interpreter(parent: Path, traversable: bool = True) -> Path:
    """A venv under /tmp whose interpreter sees this project's packages (through a .pth file)."""
    parent.mkdir(parents=True, exist_ok=True)
    venv = parent / "venv"
    subprocess.run(
        [Path(sys.base_prefix) / "bin" / "python3", "-m", "venv", "--without-pip", str(venv)], check=True
    )
    site = next((venv / "lib").glob("python3*/site-packages"))
    # addsitedir, not a bare path: the project's own .pth files there (its editable installs, the
    # client's among them) must be read too.
    purelib = sysconfig.get_paths()["purelib"]
    (site / "project.pth").write_text(f"import site; site.addsitedir({purelib!r})\n")
    mode = 0o755 if traversable else 0o700
    parent.chmod(mode)
    return venv / "bin" / "python"


def cli(
    *args: str, python: str | Path = sys.executable, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(python), "-m", "codegym_cli.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


@pytest.fixture
def tmp_under_tmp() -> Iterator[Path]:
    import shutil
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="cg-checkout-", dir="/tmp"))
    folder.chmod(0o755)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.jail
def test_a_worker_whose_interpreter_lives_under_tmp_serves_and_keeps_scratch_clean(
    tmp_under_tmp: Path,
) -> None:
    python = tmp_interpreter(tmp_under_tmp / "checkout")
    worker = CodegymServer(["serve", "sandbox", "--port", "0", "--jails", "1"], python=str(python))
    try:
        with grpc.insecure_channel(worker.address) as channel:
            stub = pb_grpc.SandboxServiceStub(channel)

            def script(code: str) -> pb.OperationResult:
                op = pb.Operation(source=pb.SourceRef(code=code), run_script=pb.RunScriptOp())
                return stub.Execute(pb.ExecuteRequest(operation=op), timeout=30).result

            wrote = script("open('/tmp/scratch.txt', 'w').write('x'); import sys; print(sys.executable)")
            assert wrote.status == pb.STATUS_OK, wrote.message + wrote.stderr
            assert wrote.stdout.strip() == str(python.parent / "python3")  # the jail runs the venv's python3
            after = script(
                "import os; print(os.path.exists('/tmp/scratch.txt'), os.path.exists(__import__('sys').executable))"
            )
            assert after.status == pb.STATUS_OK and after.stdout.split() == ["False", "True"]
    finally:
        assert worker.stop() == 0


@pytest.mark.jail
def test_a_jail_that_cannot_start_says_why_in_one_line_and_leaves_nothing(tmp_under_tmp: Path) -> None:
    python = tmp_interpreter(tmp_under_tmp / "private", traversable=False)
    script = tmp_under_tmp / "hello.py"
    script.write_text("print('hello')\n")
    command = subprocess.Popen(
        [str(python), "-m", "codegym_cli.cli", "sandbox", "run", str(script), "--op", "script"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    _, stderr = command.communicate(timeout=120)
    assert command.returncode == 1
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr
    assert lines[0].startswith("codegym: jail 0 did not start:") and "Permission denied" in lines[0]
    # Its own work folder (named with its pid) is gone; other processes' folders are not its business.
    assert not list(Path("/tmp").glob(f"codegym-sandbox-{command.pid}-*"))


def test_a_port_in_use_is_said_once_without_grpc_core_lines(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        result = cli("up", "--port", "0", "--library", str(tmp_path / "lib.db"), "--sandbox-port", port)
    assert result.returncode == 1
    assert f"codegym: cannot bind 127.0.0.1:{port}: address in use" in result.stderr
    assert not re.search(r"^[EWI]\d{4} ", result.stderr, re.MULTILINE), result.stderr  # gRPC core's log lines
    assert "add_port" not in result.stderr and "is the port in use" not in result.stderr
    assert "sandbox worker 1 did not start" in result.stderr


@pytest.mark.jail
def test_no_asyncio_warning_when_a_local_worker_stops(tmp_path: Path) -> None:
    script = tmp_path / "hello.py"
    script.write_text("print('hello')\n")
    result = cli("sandbox", "run", str(script), "--op", "script")
    assert result.returncode == 0, result.stderr
    assert "exit status already read" not in result.stderr and "WARNING" not in result.stderr


def test_library_commands_tell_the_truth_in_their_exit_codes(tmp_path: Path) -> None:
    library = tmp_path / "lib.db"
    nothing = cli("library", "import", str(tmp_path / "missing.py"), "--library", str(library))
    assert nothing.returncode == 1 and "nothing usable was imported" in nothing.stderr
    broken = tmp_path / "Bad_1_I__BrokenEnv.py"
    broken.write_text("class BrokenEnv(:\n")
    assert cli("library", "import", str(broken), "--library", str(library)).returncode == 1
    typo = tmp_path / "typo.db"
    for args in (
        ["list"],
        ["show", "Sample_0001_I__MaxSubarraySumEnv"],
        ["oracle", "--out", str(tmp_path / "o.jsonl")],
    ):
        result = cli("library", *args, "--library", str(typo))
        assert result.returncode == 2, args
        assert (
            result.stderr.strip()
            == f"codegym library: no library at {typo} (build one with 'codegym library import')"
        )
        assert not typo.exists()


def test_output_into_a_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    library = tmp_path / "lib.db"
    assert cli("library", "import", str(ENV_DIR), "--library", str(library)).returncode == 0
    proc = subprocess.Popen(
        [sys.executable, "-m", "codegym_cli.cli", "library", "list", "--library", str(library)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # like `| head -0`: the reader is gone before anything is written
    stderr = proc.stderr.read().decode()
    assert proc.wait(60) == 0 and stderr == ""


def test_an_unreachable_llm_endpoint_fails_in_seconds_with_one_line(tmp_path: Path) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # bound, never listening: connections are refused
        url = f"http://127.0.0.1:{port}/v1"
        started = time.monotonic()
        result = cli(
            "synthesize",
            "--problems",
            str(SAMPLES / "problems.jsonl"),
            "--out",
            str(tmp_path / "o"),
            "--llm-base-url",
            url,
        )
        elapsed = time.monotonic() - started
    assert result.returncode == 1
    assert elapsed < 30, elapsed  # was over a minute of back-off for a connection that cannot succeed
    lines = [line for line in result.stderr.splitlines() if "cannot reach the LLM endpoint" in line]
    assert len(lines) == 1 and url in result.stderr.replace("\n", "")


def test_a_remote_endpoint_without_a_key_is_refused_before_any_work(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "codegym_cli.cli",
            "synthesize",
            "--problems",
            str(SAMPLES / "problems.jsonl"),
            "--out",
            str(tmp_path / "o"),
            "--llm-base-url",
            "https://api.example.com/v1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=env,
    )
    assert result.returncode == 2 and "needs an API key" in result.stderr.replace("\n", " ")
    assert not (tmp_path / "o").exists()


@pytest.mark.jail
def test_sandbox_run_prints_numbers_as_numbers(tmp_path: Path) -> None:
    import json

    script = tmp_path / "hello.py"
    script.write_text("print('hello')\n")
    result = cli("sandbox", "run", str(script), "--op", "script")
    assert result.returncode == 0, result.stderr
    usage = json.loads(result.stdout)["usage"]
    assert isinstance(usage["peak_rss_kb"], int) and usage["peak_rss_kb"] > 0


def test_every_command_help_says_what_it_does_its_defaults_and_an_example() -> None:
    from codegym_cli.cli import build_parser, commands

    found = commands(build_parser())
    assert len(found) >= 17
    for words, parser, _ in found:
        text = parser.format_help()
        name = " ".join(words)
        assert parser.description and len(parser.description) > 20, name
        assert "\nExample:\n  codegym " + name in text, name
        with_defaults = [
            a
            for a in parser._actions
            if a.option_strings and a.help and a.default not in (None, False, argparse.SUPPRESS)
        ]
        if with_defaults:
            assert "(default: " in text, name
    fake = subprocess.run(
        [sys.executable, "-m", "codegym_testkit.fake_llm", "--help"],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
    )
    assert fake.returncode == 0 and "usage:" in fake.stdout and "--port" in fake.stdout


@pytest.mark.jail
def test_a_worker_sweeps_the_folders_of_workers_that_were_killed(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = Path("/tmp") / f"codegym-sandbox-{dead.pid}-abcd1234"
    stale.mkdir()
    (stale / "jail-0.log").write_text("old\n")
    script = tmp_path / "hello.py"
    script.write_text("print('hello')\n")
    assert cli("sandbox", "run", str(script), "--op", "script").returncode == 0
    assert not stale.exists()
    # ... and leaves none of its own: every folder left names a process that still runs
    owners = [p.name.split("-")[2] for p in Path("/tmp").glob("codegym-sandbox-*-*")]
    assert all(Path(f"/proc/{pid}").exists() for pid in owners if pid.isdigit())
