"""Building the library-scale bench's libraries once, measured: the working tree's `codegym library
import` (wall time, CPU, the child's peak RSS and its tree's peak PSS), and each stack's own copy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.common import Figures, Line, progress
from bench.library_data import (
    ROOT,
    SAMPLE_ENVS,
    SAMPLE_TASKS,
    Sample,
    VariantLines,
    Variants,
    write_py_folder,
)
from bench.stacks import StackSpec
from codegym import proctree

# ---------------------------------------------------------------------------------------------
# Importing, measured: the working tree's `codegym library import`, wall time and peak RSS.


@dataclass
class Built:
    """A library built once, given (copied) to every stack."""

    label: str  # the tables' point: "12 envs", "13,200 envs"
    path: Path
    form: str  # what was imported
    figures: Figures
    lines: Sequence[Line]  # what the rollouts replay on it
    probe_env: str  # an env id the start-up probe asks for


def library_counts(path: Path) -> tuple[int, int]:
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        envs = db.execute("SELECT COUNT(*) FROM envs").fetchone()[0]
        tasks = db.execute("SELECT COUNT(*) FROM tasks").fetchone()[0]
    return int(envs), int(tasks)


# `python -c HWM_MAIN HWM_FILE ARGS...` runs `codegym ARGS...` and writes its VmHWM (peak RSS, KiB) to
# HWM_FILE at exit. Not wait4's ru_maxrss: Linux folds the memory of the image before exec (the
# forked or vforked copy of this bench, hundreds of MiB once pyarrow is in) into the child's
# ru_maxrss, while VmHWM is the new image's own.
HWM_MAIN = """
import atexit, runpy, sys

out = sys.argv.pop(1)
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            open(out, "w").write(line.split()[1])
atexit.register(hwm)
sys.argv[0] = "codegym"
runpy.run_module("codegym_cli.cli", run_name="__main__", alter_sys=True)
"""


def vm_hwm_kb(pid: int) -> int:
    """A live process's VmHWM in KiB (0 when gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree_pss_kb(root: int) -> int:
    """PSS in KiB summed over a process and its descendants now (the importer's worker processes)."""
    total = 0
    for pid in proctree.descendants([root]):
        memory = proctree.memory_kb(pid)
        total += memory.get("Pss", 0) if memory else 0
    return total


def run_import(paths: list[Path], db: Path, log: Path, timeout_s: float) -> Figures:
    """`codegym library import PATHS --library DB` (the working tree's) as a child: wall seconds
    (its interpreter's start included), CPU seconds (its worker processes included), the importing
    process's peak RSS (VmHWM: as it wrote it at exit, else as last polled), the peak PSS of its
    whole tree (polled every 50 ms), and what the library holds."""
    db.unlink(missing_ok=True)
    hwm_file = log.with_name("import.hwm")
    hwm_file.unlink(missing_ok=True)
    argv = [sys.executable, "-c", HWM_MAIN, str(hwm_file), "library", "import", *map(str, paths)]
    argv += ["--library", str(db)]
    hwm = tree_peak = 0
    with open(log, "ab") as out:
        started = time.monotonic()
        proc = subprocess.Popen(
            argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        try:
            while not (reaped := os.wait4(proc.pid, os.WNOHANG))[0]:
                hwm = max(hwm, vm_hwm_kb(proc.pid))
                tree_peak = max(tree_peak, tree_pss_kb(proc.pid))
                if time.monotonic() - started > timeout_s:
                    progress(f"!!! import still running after {timeout_s:.0f} s: SIGKILL its processes")
                    break
                time.sleep(0.05)
        finally:
            if not reaped[0]:  # timed out, or the bench is being stopped: the whole tree, by pid
                for pid in proctree.descendants([proc.pid]):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                reaped = os.wait4(proc.pid, 0)
        wall = time.monotonic() - started
    _, status, usage = reaped
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped by wait4: Popen must not wait again
    written = hwm_file.read_text().strip() if hwm_file.exists() else ""
    envs, tasks = library_counts(db) if db.exists() else (0, 0)
    return {
        "exit_code": proc.returncode,
        "import_s": wall,
        "import_cpu_s": usage.ru_utime + usage.ru_stime,
        "peak_rss_mib": max(int(written or 0), hwm) / 1024,
        "peak_tree_pss_mib": tree_peak / 1024,
        "envs": envs,
        "tasks": tasks,
        "db_mib": db.stat().st_size / 2**20 if db.exists() else None,
        "envs_per_s": envs / wall if wall else None,
    }


def build_sample_library(workdir: Path, logs: Path, samples: list[Sample], timeout_s: float) -> Built:
    """What `codegym up` builds on first run: the sample envs and their task configs."""
    db = workdir / "library-samples.db"
    figures = run_import([SAMPLE_ENVS, SAMPLE_TASKS], db, logs / "import.log", timeout_s)
    if figures["exit_code"] or not figures["envs"]:
        raise SystemExit(f"importing the samples failed: {figures} (log {logs / 'import.log'})")
    lines = [line for sample in samples for line in sample.lines]
    label = f"{figures['envs']} envs"
    progress(f"library {label}: imported in {figures['import_s']:.1f} s")
    return Built(label, db, "sample .py files + tasks.jsonl", figures, lines, samples[0].record.env_id)


def build_scaled_library(
    workdir: Path, logs: Path, dataset: Path, variants: Variants, timeout_s: float
) -> Built:
    """The N-env library from the Parquet dataset; from the same variants as .py files + JSONL when
    the working tree cannot read Parquet yet."""
    db = workdir / "library-scaled.db"
    log = logs / "import.log"
    progress(f"importing {dataset} (Parquet, published layout)")
    figures = run_import([dataset], db, log, timeout_s)
    form = "Parquet (published layout)"
    if figures["exit_code"] or figures["envs"] < variants.n:
        progress(
            f"the working tree did not import the Parquet dataset (exit {figures['exit_code']}, "
            f"{figures['envs']} envs): importing the same variants as .py files + JSONL instead"
        )
        folder = workdir / "py-folder"
        write_py_folder(dataset, folder)
        figures = {**run_import([folder], db, log, timeout_s), "parquet_attempt": figures}
        form = "py folder + JSONL (Parquet import not available)"
        shutil.rmtree(folder, ignore_errors=True)
    if figures["exit_code"] or figures["envs"] < variants.n:
        raise SystemExit(f"importing {variants.n} envs failed: {figures} (log {log})")
    label = f"{figures['envs']:,} envs"
    progress(
        f"library {label}: imported in {figures['import_s']:.1f} s, peak RSS {figures['peak_rss_mib']:.0f} MiB"
    )
    return Built(label, db, form, figures, VariantLines(variants), variants.env_id(variants.n - 1))


def stack_library(spec: StackSpec, built: Built, workdir: Path) -> StackSpec:
    """The stack with its own copy of the library (a stack may write to the file it is given)."""
    copy = workdir / f"{spec.name}-{built.path.name}"
    if not copy.exists():
        shutil.copyfile(built.path, copy)
        wal = built.path.with_name(built.path.name + "-wal")
        if wal.exists():
            shutil.copyfile(wal, copy.with_name(copy.name + "-wal"))
    return dataclasses.replace(spec, library=copy)
