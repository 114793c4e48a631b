"""The progress bar the long-running commands show on stderr (so stdout keeps only their tables)."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


def stderr_progress(*, transient: bool = True) -> Progress:
    """Description, bar, done/total and elapsed time, on stderr; `transient` clears it at the end."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=transient,
    )
