"""Append-only JSON-lines files that a job resumes (eval's episodes and failures, replay's state).

A line is a record once its newline is written. A writer killed mid-line leaves a fragment after
the last newline; the next run must not append right after it, or its first new line would be
glued to the fragment and unreadable, so that record would be lost to every reader. `open_to_append`
cuts the fragment off first (its record was never finished, so the run that resumes redoes it),
and is the one way these files are opened for appending.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TextIO

CHUNK = 1 << 16  # read back from the end this much at a time, looking for the last newline


def cut_torn_tail(path: Path) -> int:
    """Cut whatever follows the last newline of `path` (a line a killed writer left unfinished);
    returns how many bytes were cut (0: the file ends with a whole line, is empty, or is absent)."""
    try:
        file = open(path, "r+b")  # noqa: SIM115 (closed below; absent is not an error)
    except FileNotFoundError:
        return 0
    with file:
        size = file.seek(0, os.SEEK_END)
        end = size
        while end > 0:
            start = max(0, end - CHUNK)
            file.seek(start)
            newline = file.read(end - start).rfind(b"\n")
            if newline >= 0:
                keep = start + newline + 1
                break
            end = start
        else:
            keep = 0
        if keep < size:
            file.truncate(keep)
            file.flush()
            os.fsync(file.fileno())
        return size - keep


def open_to_append(path: Path) -> TextIO:
    """`path` opened for appending JSON lines (UTF-8), its torn last line cut first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    cut_torn_tail(path)
    return open(path, "a", encoding="utf-8")


def whole_lines(path: Path) -> list[str]:
    """The lines of `path` that are records: those ending with a newline (a torn last line is not
    one, even when it happens to parse); none when the file is absent."""
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8", errors="replace")
    return text[: text.rfind("\n") + 1].splitlines()
