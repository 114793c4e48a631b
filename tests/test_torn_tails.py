"""Append-only JSON-lines files that a job resumes (codegym_jobs/appending.py): a writer killed
mid-line leaves a fragment, and the run that resumes cuts it before appending, so no new line is
glued to it and the fragment's record is written again, whole."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from codegym_jobs.appending import CHUNK, cut_torn_tail, open_to_append, whole_lines
from codegym_jobs.replay.playing import StateFile
from tests.conftest import ROOT

# A resumable writer, as the jobs write: it reads the records already written, then appends the
# others, one line each. With a record number after the path, it writes that record's line half
# way (flushed: the bytes are in the file), says so, and waits to be killed.
WRITER = """
import json, sys
from pathlib import Path
from codegym_jobs.appending import open_to_append, whole_lines

path, total = Path(sys.argv[1]), int(sys.argv[2])
tear_at = int(sys.argv[3]) if len(sys.argv) > 3 else -1
with open_to_append(path) as sink:
    done = {json.loads(line)["n"] for line in whole_lines(path)}
    for n in range(total):
        if n in done:
            continue
        line = json.dumps({"n": n, "body": "x" * 5000}) + "\\n"
        if n == tear_at:
            sink.write(line[: len(line) // 2])
            sink.flush()
            print("torn", flush=True)
            sys.stdin.read()  # until killed
        sink.write(line)
        sink.flush()
"""


def write(path: Path, total: int, *tear_at: int) -> subprocess.Popen[str]:
    argv = [sys.executable, "-c", WRITER, str(path), str(total), *map(str, tear_at)]
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)


def test_a_writer_killed_mid_line_is_resumed_without_gluing_a_line_to_the_fragment(tmp_path: Path) -> None:
    path = tmp_path / "episodes.jsonl"
    writer = write(path, 12, 5)
    try:
        assert writer.stdout is not None and writer.stdout.readline() == "torn\n"
        writer.send_signal(signal.SIGKILL)
        assert writer.wait(30) == -signal.SIGKILL
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait(30)
    text = path.read_text()
    assert not text.endswith("\n") and text.count("\n") == 5  # records 0-4, then half of 5
    before = text[: text.rfind("\n") + 1]

    resumed = write(path, 12)
    assert resumed.wait(60) == 0
    after = path.read_text()
    assert after.startswith(before)  # what was whole is kept as it was
    records = [json.loads(line) for line in after.splitlines()]  # every line whole: none glued
    assert [r["n"] for r in records] == list(range(12))  # record 5, torn, written again
    assert all(len(r["body"]) == 5000 for r in records)


@pytest.mark.parametrize(
    ("content", "kept"),
    [
        (b"", b""),
        (b'{"a": 1}\n', b'{"a": 1}\n'),
        (b'{"a": 1}\n{"b"', b'{"a": 1}\n'),
        (b'{"a": 1}', b""),  # a line with no newline is torn, even when it parses
        (b'{"a": 1}\n' + b"y" * (3 * CHUNK), b'{"a": 1}\n'),  # a fragment longer than a chunk
        (b"z" * (2 * CHUNK) + b"\n" + b"w" * 10, b"z" * (2 * CHUNK) + b"\n"),
    ],
)
def test_the_cut_keeps_every_whole_line(tmp_path: Path, content: bytes, kept: bytes) -> None:
    path = tmp_path / "f.jsonl"
    path.write_bytes(content)
    assert cut_torn_tail(path) == len(content) - len(kept)
    assert path.read_bytes() == kept


def test_an_absent_file_is_created_for_appending(tmp_path: Path) -> None:
    path = tmp_path / "new" / "f.jsonl"
    assert cut_torn_tail(path) == 0 and whole_lines(path) == []
    with open_to_append(path) as sink:
        sink.write("{}\n")
    assert path.read_text() == "{}\n"


def test_replays_state_file_replays_the_task_whose_line_was_torn(tmp_path: Path) -> None:
    path = tmp_path / "replay.state"
    whole = [
        {"task_id": 1, "key": "k1", "outcome": "finished"},
        {"task_id": 2, "key": "k2", "outcome": "finished"},
    ]
    torn = json.dumps({"task_id": 3, "key": "k3", "outcome": "finished"})
    path.write_text("".join(json.dumps(line) + "\n" for line in whole) + torn[:-1])
    state = StateFile(path)
    try:
        assert sorted(state.done) == [1, 2] and state.finished(3, "k3") is None  # task 3 is replayed
        state.record({"task_id": 3, "key": "k3", "outcome": "finished"})
    finally:
        state.close()
    assert [json.loads(line)["task_id"] for line in path.read_text().splitlines()] == [1, 2, 3]
