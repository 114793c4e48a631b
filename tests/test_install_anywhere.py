"""Install anywhere: a venv the jails cannot reach is said in one line, with the command that fixes it.

nsjail mounts the interpreter and the package as the jail's unprivileged uid, so a venv under a
folder of mode 0700 (a home folder) made `codegym up` fail with nsjail's mount error. Now `codegym
up` and `codegym serve sandbox` check first and stop with the one chmod that opens the way; once it
has run, the same install serves. The venv here is a non-editable `pip install` of this project
(its jail package inside the venv), made from hard links of the project's venv, under a 0700
folder.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from codegym.sandbox.v1 import sandbox_service_pb2 as pb
from codegym.sandbox.v1 import sandbox_service_pb2_grpc as pb_grpc
from sandbox_worker.limits import unreachable_by_jails
from tests.conftest import ROOT
from tests.helpers.servers import CodegymServer

PACKAGES = ("codegym", "codegym_jobs", "codegym_cli", "sandbox_worker", "services")


@pytest.fixture
def private() -> Iterator[Path]:
    """A folder under /tmp that only its owner may enter (what mkdtemp makes: mode 0700)."""
    folder = Path(tempfile.mkdtemp(prefix="codegym-0700-", dir="/tmp"))
    assert folder.stat().st_mode & 0o777 == 0o700
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_a_folder_others_cannot_enter_or_files_they_cannot_read_are_named_with_the_fix(private: Path) -> None:
    venv = private / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python3"
    python.write_text("")
    python.chmod(0o755)
    problem = unreachable_by_jails([venv], [python])
    assert f"others cannot enter {private}" in problem
    assert problem.endswith(f"fix: chmod o+x {private}")
    private.chmod(0o711)  # what the command does
    assert unreachable_by_jails([venv], [python]) == ""
    python.chmod(0o700)  # installed under umask 077
    assert unreachable_by_jails([venv], [python]).endswith(f"fix: chmod -R o+rX {venv}")


def test_this_install_is_reachable() -> None:
    assert unreachable_by_jails() == ""


def cli(python: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(python), "-m", "codegym_cli.cli", *args], capture_output=True, text=True, timeout=120, cwd="/"
    )


@pytest.mark.slow
@pytest.mark.jail
def test_a_pip_install_under_a_0700_folder_says_the_fix_in_one_line_then_serves(private: Path) -> None:
    venv = private / "venv"
    # The project's venv as hard links (seconds, no download), then this project installed into it
    # as a user would, not editable: the jail's package then lives in the venv too.
    subprocess.run(["cp", "-al", sys.prefix, str(venv)], check=True)
    source = private / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for package in PACKAGES:
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    python = venv / "bin" / "python3"
    pip = [
        str(python),
        "-m",
        "pip",
        "install",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "--no-compile",
    ]
    subprocess.run([*pip, str(source)], check=True, capture_output=True, timeout=300)
    shutil.rmtree(source)
    where = subprocess.run(
        [str(python), "-c", "import codegym.inside; print(codegym.inside.__file__)"],
        capture_output=True,
        text=True,
        cwd="/",
        check=True,
    )
    assert where.stdout.startswith(str(venv)), where.stdout  # not the checkout

    fix = f"chmod o+x {private}"
    worker = cli(python, "serve", "sandbox", "--port", "0", "--jails", "1")
    assert worker.returncode != 0
    lines = worker.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("codegym serve sandbox: jails run as an unprivileged uid")
    assert lines[0].endswith(f"fix: {fix}"), lines
    up = cli(python, "up", "--library", str(private / "lib.db"), "--port", "0", "--workers", "1")
    assert up.returncode != 0 and up.stderr.strip().splitlines() == [
        f"codegym up: {lines[0].split(': ', 1)[1]}"
    ]
    assert not (private / "lib.db").exists()  # stopped before anything was built or started

    subprocess.run(fix, shell=True, check=True)
    served = CodegymServer(["serve", "sandbox", "--port", "0", "--jails", "1"], python=str(python))
    try:
        with grpc.insecure_channel(served.address) as channel:
            stub = pb_grpc.SandboxServiceStub(channel)
            code = "import sys, gymnasium, numpy; print(sys.prefix, numpy.__name__)"
            op = pb.Operation(source=pb.SourceRef(code=code), run_script=pb.RunScriptOp())
            result = stub.Execute(pb.ExecuteRequest(operation=op), timeout=60).result
        assert result.status == pb.STATUS_OK, result.message + result.stderr
        assert result.stdout.split() == [str(venv), "numpy"]
    finally:
        assert served.stop() == 0
    assert os.stat(private).st_mode & 0o777 == 0o701  # o+x only: others still cannot list it
