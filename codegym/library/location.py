"""Where a library is when no command names one, and the files kept beside it.

Standard library only: every command's `--library` default is read from here when its parser is
built, `codegym --help` included."""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def default_library_path() -> Path:
    """`$CODEGYM_LIBRARY`, else `$XDG_DATA_HOME/codegym/library.db` (~/.local/share by default)."""
    if os.environ.get("CODEGYM_LIBRARY"):
        return Path(os.environ["CODEGYM_LIBRARY"])
    base = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    return base / "codegym" / "library.db"


def tokens_path(library: Path) -> Path:
    """Where `codegym up --auth` keeps the access tokens of the servers it starts over `library`
    (and reads them when there, so a token a trainer exported stays good)."""
    return library.with_name(f"{library.stem}.tokens.json")


def add_library_argument(
    parser: argparse.ArgumentParser | argparse._MutuallyExclusiveGroup,
    help: str = "library file",
    metavar: str = "FILE",
) -> None:
    """`--library FILE`, by default `default_library_path()`: every command that reads or writes a
    library takes it so (the runtime's is its settings' `library`, with the same default)."""
    parser.add_argument("--library", default=str(default_library_path()), metavar=metavar, help=help)
