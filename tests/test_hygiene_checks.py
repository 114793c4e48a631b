"""The zygote's cheap hygiene checks (`codegym.inside.hygiene`) against real processes, /proc and
tmpfs: each gives the answer the folder listing it replaces gives, and where the kernel does not
keep the count it reads (seen at the jail's start), the listing is used instead.

Through a real jail, the guarantees they serve are tested in `test_resident.py` (a process that
leaves a thread running is not kept; /tmp does not outlive a resident step) and `test_sandbox.py`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from codegym.inside import hygiene
from codegym.inside.hygiene import JailFacts, one_thread, tmp_entry_count
from tests.helpers.processes import wait_until

# A process that runs `threads` threads besides its main one until its stdin closes, and says so.
THREADED = """
import sys, threading
done = threading.Event()
for _ in range({threads}):
    threading.Thread(target=done.wait, daemon=True).start()
print("ready", flush=True)
sys.stdin.read()
"""


def start(threads: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", THREADED.format(threads=threads)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc


def task_fd(pid: int) -> int:
    return os.open(f"/proc/{pid}/task", os.O_RDONLY | os.O_DIRECTORY)


def test_the_kernel_counts_threads_where_the_jail_reads_them() -> None:
    """In a process of its own (this one runs pytest's threads): one thread, then the probe's."""
    code = "from codegym.inside.hygiene import thread_links; print(thread_links())"
    links = int(
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    )
    assert links > 0  # this kernel keeps the count: the jail reads it with one fstat


@pytest.fixture(params=["links", "listing"])
def counting(request: pytest.FixtureRequest) -> Iterator[str]:
    """Both ways `one_thread` counts: the link count (as the probe found it) and the listing."""
    saved = JailFacts.one_thread_links
    code = "from codegym.inside.hygiene import thread_links; print(thread_links())"
    probed = int(
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    )
    JailFacts.one_thread_links = probed if request.param == "links" else 0
    yield request.param
    JailFacts.one_thread_links = saved


def test_one_thread_tells_a_lone_thread_from_more_and_from_none(counting: str) -> None:
    alone, threaded = start(0), start(2)
    fds = {proc.pid: task_fd(proc.pid) for proc in (alone, threaded)}
    try:
        assert one_thread(fds[alone.pid])
        assert not one_thread(fds[threaded.pid])
    finally:
        for proc in (alone, threaded):
            proc.communicate("")
    # Exited and reaped: no thread at all, read from the same fd.
    assert not one_thread(fds[alone.pid])
    for fd in fds.values():
        os.close(fd)


@pytest.fixture
def tmpfs_folder() -> Iterator[Path]:
    folder = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="codegym-hygiene-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def fstype(path: Path) -> str:
    """The type of the filesystem `path` lies on (its longest mount point in /proc/self/mountinfo)."""
    best, kind = "", ""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        point, after = fields[4], fields[fields.index("-") + 1]
        if str(path.resolve()).startswith(point.rstrip("/") + "/") and len(point) > len(best):
            best, kind = point, after
    return kind


def test_an_empty_tmpfs_folder_is_known_empty_by_its_size_and_any_entry_shows(tmpfs_folder: Path) -> None:
    fd, empty = tmp_entry_count(str(tmpfs_folder))
    assert fd >= 0 and empty >= 0 and not (tmpfs_folder / ".codegym-probe").exists()
    saved = (JailFacts.tmp_fd, JailFacts.empty_tmp_size)
    JailFacts.tmp_fd, JailFacts.empty_tmp_size = fd, empty
    entry, renamed = tmpfs_folder / "entry", tmpfs_folder / "renamed"
    try:
        assert hygiene.tmp_empty()
        for make in (
            lambda: entry.write_text("x"),
            entry.mkdir,
            lambda: entry.symlink_to("/nowhere"),
            lambda: os.mkfifo(entry),
        ):
            make()
            assert not hygiene.tmp_empty()
            entry.rename(renamed)
            assert not hygiene.tmp_empty()
            if renamed.is_dir() and not renamed.is_symlink():
                renamed.rmdir()
            else:
                renamed.unlink()
            assert hygiene.tmp_empty()
    finally:
        JailFacts.tmp_fd, JailFacts.empty_tmp_size = saved
        os.close(fd)


def test_a_folder_that_holds_entries_or_whose_size_counts_none_is_always_listed(
    tmp_path: Path, tmpfs_folder: Path
) -> None:
    (tmpfs_folder / "left").write_text("x")
    assert tmp_entry_count(str(tmpfs_folder)) == (-1, -1)  # not empty: never taken for empty
    assert not (tmpfs_folder / ".codegym-probe").exists()
    if fstype(tmp_path) == "tmpfs":
        pytest.fail(f"{tmp_path} is on a tmpfs here: no folder to test whose size counts nothing")
    assert tmp_entry_count(str(tmp_path)) == (-1, -1)
    assert list(tmp_path.iterdir()) == []  # the probe did not stay


def test_the_pid_counter_is_read_in_place() -> None:
    saved = JailFacts.last_pid_fd
    JailFacts.last_pid_fd = os.open("/proc/sys/kernel/ns_last_pid", os.O_RDONLY)
    try:
        before = hygiene.last_pid()
        assert before > 0
        subprocess.run(["true"], check=True)
        wait_until(lambda: hygiene.last_pid() != before, 5, "the counter to move on")
    finally:
        os.close(JailFacts.last_pid_fd)
        JailFacts.last_pid_fd = saved
