"""The jail's frames (`codegym.inside.frames`): a JSON head and raw binary parts, read and checked
the same way on every side of every pipe.

Every bad input is a `ValueError` naming what is wrong, before any of the frame is used; a good
frame comes back as sent, its parts as views of the bytes read. These run on real pipes (what the
worker, the zygote and its children talk over); the same checks seen from a hostile child, through
a real jail, are in `test_resident.py` (`test_a_malformed_answer_is_the_childs_failure...`).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

import pytest

from codegym.inside import frames
from codegym.inside.frames import MAX_FRAME, PREFIX
from codegym.inside.messages import REQUEST_PARTS, RESULT_PARTS
from codegym.sandbox.v1 import sandbox_service_pb2 as pb
from sandbox_worker.service import to_result

STATE = bytes(range(256)) * 40  # every byte value: raw, nothing escaped or encoded
HEAD = b'{"status":"ok"}'


@pytest.fixture
def pipe() -> Iterator[tuple[int, int]]:
    r, w = os.pipe()
    yield r, w
    for fd in (r, w):
        with contextlib.suppress(OSError):  # a test may have closed one
            os.close(fd)


def test_a_message_and_its_parts_come_back_as_sent() -> None:
    message = {"op": "step", "action": "é\ud800", "state": STATE, "code": b"\x00code"}
    data = frames.encode(message)
    head_size, state_size, code_size = PREFIX.unpack(data[: PREFIX.size])
    assert (state_size, code_size) == (len(STATE), 5)
    # The parts follow the head raw, in their declared order; the head holds no part.
    assert data.endswith(STATE + b"\x00code") and b'"state"' not in data[: PREFIX.size + head_size]
    back = frames.decode(data)
    assert {k: bytes(v) if isinstance(v, memoryview) else v for k, v in back.items()} == message
    assert isinstance(back["state"], memoryview)  # a view of what was read, not a copy


def test_an_empty_part_is_absent_and_a_frame_without_parts_is_its_head() -> None:
    data = frames.encode({"status": "ok", "state": b""})
    assert data == PREFIX.pack(len(HEAD), 0, 0) + HEAD
    assert frames.decode(data) == {"status": "ok"}
    assert b"".join(frames.head_only(HEAD)) == data


def test_a_large_frame_goes_whole_through_a_pipe(pipe: tuple[int, int]) -> None:
    """Far more than a pipe holds: `write_all` goes on after the partial writes of `writev`."""
    r, w = pipe
    state = os.urandom(3 * 1024 * 1024 + 7)
    writer = threading.Thread(target=frames.send, args=(w, {"status": "ok", "state": state}))
    writer.start()
    got = frames.read(r, RESULT_PARTS)
    writer.join()
    assert got is not None and bytes(got["state"]) == state and got["status"] == "ok"


def test_the_end_of_the_pipe_before_a_frame_is_none(pipe: tuple[int, int]) -> None:
    r, w = pipe
    os.close(w)
    assert frames.read(r) is None


def test_a_frame_cut_short_is_refused(pipe: tuple[int, int]) -> None:
    r, w = pipe
    os.write(w, frames.encode({"status": "ok", "state": STATE})[:-1])
    os.close(w)
    with pytest.raises(ValueError, match="cut short"):
        frames.read(r)


def test_a_frame_past_the_limit_is_refused_before_its_bytes_are_read(pipe: tuple[int, int]) -> None:
    """Its prefix alone says so: nothing waits for (or allocates) the bytes it claims."""
    r, w = pipe
    os.write(w, PREFIX.pack(len(HEAD), MAX_FRAME, 0))  # and nothing more: the pipe stays open
    with pytest.raises(ValueError, match="max"):
        frames.read(r)
    os.write(w, PREFIX.pack(len(HEAD), 1000, 0))
    with pytest.raises(ValueError, match=r"1015 bytes \(max 1000\)"):
        frames.read(r, limit=1000)


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (PREFIX.pack(len(HEAD), 10, 0) + HEAD, "do not add up"),
        (PREFIX.pack(len(HEAD), 0, 0) + HEAD + b"trailing", "do not add up"),
        (PREFIX.pack(len(HEAD) - 1, 0, 0) + HEAD[:-1], "Expecting|delimiter"),
        (PREFIX.pack(2, 0, 0)[:-1], "shorter than its prefix"),
        (PREFIX.pack(3, 0, 0) + b"[1]", "is a list, not an object"),
        (PREFIX.pack(4, 0, 0) + b'"ok"', "is a str, not an object"),
        (PREFIX.pack(3, 0, 0) + b"\xff{}", "utf-8|UTF-8|decode"),
        (PREFIX.pack(0, 0, 0), "Expecting value"),
        (PREFIX.pack(14, 0, 0) + b'{"state":"QQ"}', "holds 'state'"),
        (PREFIX.pack(10, 2, 0) + b'{"code":1}' + b"st", "holds 'code'"),
        (PREFIX.pack(200_002, 0, 0) + b"[" * 100_001 + b"]" * 100_001, "nested too deeply"),
    ],
    ids=[
        "a part longer than the bytes",
        "bytes past the frame",
        "a head cut by its length",
        "a prefix cut short",
        "a list for a head",
        "a string for a head",
        "a head that is no UTF-8",
        "no head at all",
        "a state in the head",
        "code in the head",
        "a head nested past the decoder",
    ],
)
def test_a_malformed_frame_is_refused_with_its_reason(data: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        frames.decode(data)


def test_a_result_never_carries_code() -> None:
    data = frames.encode({"status": "ok", "state": b"s", "code": b"c"})
    assert bytes(frames.decode(data, REQUEST_PARTS)["code"]) == b"c"
    with pytest.raises(ValueError, match="'code' part"):
        frames.decode(data, RESULT_PARTS)


def test_the_worker_takes_a_state_only_as_bytes() -> None:
    """What reaches `to_result` is checked again: a state that is not bytes (whatever produced it)
    is a malformed answer, CRASHED, never passed on."""
    good = to_result({"status": "ok", "state": memoryview(STATE)}, "sha")
    assert good.status == pb.STATUS_OK and good.state == STATE
    bad = to_result({"status": "ok", "state": "Q0dTMQ=="}, "sha")  # type: ignore[typeddict-item]
    assert bad.status == pb.STATUS_CRASHED and "state is a str" in bad.message and bad.state == b""
