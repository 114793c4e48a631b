"""The library bench's import probe (`bench/library_build.run_import`) runs a real import.

`make bench-library` starts by importing the 12 samples through a small script that wraps
`codegym library import` to record the child's peak RSS. That script is a string the bench runs
with `python -c`, so nothing else checks it: once, a line left in it by a refactor (a `NameError`)
made every bench run stop at its first step. This runs it on the samples and reads what it says.
"""

from __future__ import annotations

from pathlib import Path

from bench.library_build import run_import
from bench.library_data import SAMPLE_ENVS, SAMPLE_TASKS


def test_the_probe_imports_the_samples_and_reads_the_childs_peak_memory(tmp_path: Path) -> None:
    figures = run_import([SAMPLE_ENVS, SAMPLE_TASKS], tmp_path / "lib.db", tmp_path / "import.log", 120)
    assert figures["exit_code"] == 0, (tmp_path / "import.log").read_text()
    assert (figures["envs"], figures["tasks"]) == (12, 108)
    # The peak the child wrote at exit: an interpreter that imported the library holds tens of MiB.
    assert figures["peak_rss_mib"] > 10
    assert (tmp_path / "import.hwm").read_text().strip().isdigit()
