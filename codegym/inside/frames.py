"""Length-prefixed JSON frames: a 4-byte big-endian length, then that many bytes of JSON.

One format on every pipe: worker <-> zygote (the jail's stdin/stdout) and zygote <-> its children.
"""

import json
import os
import struct
from collections.abc import Mapping

HEADER = struct.Struct(">I")
# Largest frame either side accepts (a result with a large pickled state and captured output).
MAX_FRAME = 64 * 1024 * 1024


def read_exact(fd: int, n: int) -> bytes | None:
    """Exactly `n` bytes, or None at end of file (the other side closed the pipe)."""
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def frame(body: bytes) -> bytes:
    return HEADER.pack(len(body)) + body


def encode(obj: Mapping[str, object]) -> bytes:
    return frame(json.dumps(obj, separators=(",", ":")).encode())


def send(fd: int, obj: Mapping[str, object]) -> None:
    write_all(fd, encode(obj))


def read_body(fd: int) -> bytes | None:
    """One frame's body, or None at end of file."""
    header = read_exact(fd, HEADER.size)
    if header is None:
        return None
    (length,) = HEADER.unpack(header)
    if length > MAX_FRAME:
        raise ValueError(f"frame of {length} bytes (max {MAX_FRAME})")
    return read_exact(fd, length)
