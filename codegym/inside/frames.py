"""Frames: the one format on every pipe of a jail, worker <-> zygote (the jail's stdin/stdout) and
zygote <-> its children.

A frame is a fixed binary prefix, a JSON object (the head), then the message's binary parts, raw:

    PREFIX  three big-endian uint32: the head's length, then each part's, in `messages.PARTS` order
    head    a JSON object (UTF-8): every key of the message but its parts
    parts   the bytes of each part, in the same order (`state`, then `code`)

A message is the head's dict with each non-empty part set under its key (as a `memoryview` of
the frame, or `bytes`); a part of length 0 is absent. Why the parts travel raw: a session's state
is the bulk of a step's bytes, and as base64 inside the JSON every hop (worker, zygote, child and
back) encoded it, scanned it as a JSON string and decoded it. Raw, each side reads it once, and the
zygote relays it without looking at it: it parses the small head only, and forwards a resident
step's head as the worker wrote it (`head_only`).

Everything a frame says is checked before anything of it is used (`parse`): its lengths add up to
what came, its head is a JSON object that holds no part's key, it has only the parts its direction
allows. A frame that fails is a `ValueError`, whoever sent it.
"""

import json
import os
import struct
from collections.abc import Buffer, Mapping, Sequence
from typing import Any

from .messages import PARTS, Blob

PREFIX = struct.Struct(">" + "I" * (1 + len(PARTS)))
# Largest frame either side accepts (a result with a large pickled state and captured output).
MAX_FRAME = 64 * 1024 * 1024
# Bound before any environment's code runs in a child (it may monkeypatch `json`): a child's own
# code cannot change how its result is written.
_dumps = json.JSONEncoder(separators=(",", ":")).encode
_EMPTY = b""


def sizes(prefix: Buffer) -> tuple[int, ...]:
    """The head's and each part's length, as a frame's prefix states them."""
    return PREFIX.unpack(prefix)


def frame_size(prefix: Buffer) -> int:
    """The whole frame's size (prefix included), as its prefix states it."""
    return PREFIX.size + sum(PREFIX.unpack(prefix))


def parse(lengths: Sequence[int], body: Buffer, allowed: tuple[str, ...] = PARTS) -> dict[str, Any]:
    """The message of a frame's body (all of it but the prefix), checked: `lengths` (the prefix's)
    add up to the body, the head is a JSON object holding no part's key, and only the parts in
    `allowed` are there. Parts come as views of `body` (no copy)."""
    view = memoryview(body)
    head_size, *part_sizes = lengths
    if head_size + sum(part_sizes) != len(view):
        raise ValueError(f"frame lengths {list(lengths)} do not add up to its {len(view)} bytes")
    try:
        message = json.loads(bytes(view[:head_size]))
    except RecursionError:
        raise ValueError("frame head nested too deeply") from None
    if not isinstance(message, dict):
        raise ValueError(f"frame head is a {type(message).__name__}, not an object")
    offset = head_size
    for name, size in zip(PARTS, part_sizes, strict=True):
        if name in message:
            raise ValueError(f"frame head holds {name!r}, which only travels as a part")
        if size:
            if name not in allowed:
                raise ValueError(f"frame carries a {name!r} part, which this direction never has")
            message[name] = view[offset : offset + size]
            offset += size
    return message


def decode(data: Buffer, allowed: tuple[str, ...] = PARTS) -> dict[str, Any]:
    """The message of a whole frame (prefix included), checked as `parse` does."""
    view = memoryview(data)
    if len(view) < PREFIX.size:
        raise ValueError(f"frame of {len(view)} bytes is shorter than its prefix")
    return parse(PREFIX.unpack(view[: PREFIX.size]), view[PREFIX.size :], allowed)


def pack(message: Mapping[str, Any]) -> list[Blob]:
    """A message as the chunks of its frame (prefix, head, parts), for one `writev`.

    Raises TypeError or ValueError when the head has a value JSON cannot hold."""
    parts = [message.get(name) or _EMPTY for name in PARTS]
    # Most frames carry no part (a resident step's request, a hello): their head is the message.
    as_head = {k: v for k, v in message.items() if k not in PARTS} if _has_part(message) else message
    head = _dumps(as_head).encode()
    return [PREFIX.pack(len(head), *(len(p) for p in parts)), head, *parts]


def _has_part(message: Mapping[str, Any]) -> bool:
    return any(name in message for name in PARTS)


def encode(message: Mapping[str, Any]) -> bytes:
    """A message as one frame's bytes."""
    return b"".join(pack(message))


def head_only(head: bytes) -> list[Blob]:
    """A frame of a head already encoded (JSON, as another side wrote it) and no parts: how the
    zygote relays a resident step's request without decoding and encoding it again."""
    return [PREFIX.pack(len(head), *(0 for _ in PARTS)), head]


def write_all(fd: int, chunks: Sequence[Blob]) -> None:
    """Write every chunk, in order, with as few system calls as the pipe allows (one, mostly)."""
    views = [memoryview(c) for c in chunks if len(c)]
    while views:
        written = os.writev(fd, views)
        while views and written >= len(views[0]):
            written -= len(views.pop(0))
        if written:
            views[0] = views[0][written:]


def send(fd: int, message: Mapping[str, Any]) -> None:
    write_all(fd, pack(message))


def read_exact(fd: int, n: int) -> bytes | None:
    """Exactly `n` bytes, or None at end of file (the other side closed the pipe)."""
    if n == 0:
        return _EMPTY
    first = os.read(fd, n)
    if len(first) == n or not first:
        return first or None
    buf = bytearray(first)
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def read_raw(fd: int, limit: int = MAX_FRAME) -> tuple[tuple[int, ...], bytes] | None:
    """One frame's lengths and body (not parsed yet), or None at end of file. A frame larger than
    `limit`, or cut short, is a ValueError."""
    prefix = read_exact(fd, PREFIX.size)
    if prefix is None:
        return None
    lengths = PREFIX.unpack(prefix)
    if sum(lengths) > limit:
        raise ValueError(f"frame of {sum(lengths)} bytes (max {limit})")
    body = read_exact(fd, sum(lengths))
    if body is None:
        raise ValueError("frame cut short by the end of the pipe")
    return lengths, body


def read(fd: int, allowed: tuple[str, ...] = PARTS, limit: int = MAX_FRAME) -> dict[str, Any] | None:
    """One message, or None at end of file. A frame larger than `limit`, cut short or malformed
    is a ValueError."""
    raw = read_raw(fd, limit)
    return None if raw is None else parse(*raw, allowed)
