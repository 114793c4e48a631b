"""Checking environment code for the library, statically: compiled by this Python (nothing run) and
read by the contract checker, each distinct source once per import, in worker processes when a
batch brings many. What an import (library_import.py) and the pipeline's `put_environment`
(library_writes.py) keep of a source is what this says of it."""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import warnings
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

from codegym.contract import analyze_source, sha256_text, split_env_id, tool_text, tools_schema, tools_text

# Sources to check in a batch before worker processes are worth starting for them.
PARALLEL_MIN = 16
PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"


@dataclass(frozen=True)
class Analysis:
    """What the contract checker makes of one source: its class and tools, or why it cannot serve."""

    sha256: str
    env_class: str = ""
    tools_json: str = ""
    tools_text: str = ""
    reason: str = ""  # "" = it can serve
    detail: str = ""


def analyze(source: str) -> Analysis:
    """Compile `source` (this Python's parser and compiler, nothing run) and check it statically."""
    digest = sha256_text(source)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SyntaxWarnings of LLM-written code are not the import's
        try:
            compile(source, "<env>", "exec", dont_inherit=True)
        except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
            line = getattr(exc, "lineno", None)
            detail = f"{getattr(exc, 'msg', None) or exc}" + (f" (line {line})" if line else "")
            return Analysis(digest, reason=f"does not compile on Python {PYTHON}", detail=detail)
    spec = analyze_source(source)
    if spec.violations:
        detail = "; ".join(f"{v.code}: {v.message}" for v in spec.violations[:5])
        return Analysis(digest, reason="contract violations", detail=detail)
    tools = [
        {"name": t.name, "signature": t.signature, "text": tool_text(t), "schema": s}
        for t, s in zip(spec.tools, tools_schema(spec), strict=True)
    ]
    return Analysis(digest, spec.class_name, json.dumps(tools), tools_text(spec))


class Analyzer:
    """Each distinct source analysed once per import.

    A batch's sources are analysed together, in worker processes when there are many (a compile and
    the contract checker cost about 15 ms a source: the published 22,366 environments are minutes
    of one core). What failed is remembered for the whole import (task rows repeat their code in
    every row); what passed only for the batch, which writes it into the library.
    """

    def __init__(self, jobs: int | None = None) -> None:
        self.jobs = jobs or len(os.sched_getaffinity(0))
        self._pool: ProcessPoolExecutor | None = None
        self._batch: dict[str, Analysis] = {}
        self._failed: dict[str, Analysis] = {}

    def prefetch(self, sources: dict[str, str]) -> None:
        """Analyse these sources (by sha256) now, side by side when there are enough of them."""
        todo = [s for sha, s in sources.items() if sha not in self._failed and sha not in self._batch]
        results: Iterable[Analysis] = ()
        if self.jobs > 1 and len(todo) >= PARALLEL_MIN:
            try:
                results = list(
                    self._workers().map(analyze, todo, chunksize=max(1, len(todo) // (4 * self.jobs)))
                )
            except BrokenProcessPool:  # a worker died (a source crashing the compiler): go on here
                self._pool = None
        for analysis in results or map(analyze, todo):
            self._keep(analysis)

    def get(self, source: str, sha: str) -> Analysis:
        found = self._failed.get(sha) or self._batch.get(sha)
        if found is None:
            found = analyze(source)
            self._keep(found)
        return found

    def end_batch(self) -> None:
        self._batch.clear()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None

    def _keep(self, analysis: Analysis) -> None:
        (self._failed if analysis.reason else self._batch)[analysis.sha256] = analysis

    def _workers(self) -> ProcessPoolExecutor:
        if self._pool is None:
            # spawn: the importing process may hold threads (a progress bar) that fork must not copy.
            context = multiprocessing.get_context("spawn")
            self._pool = ProcessPoolExecutor(max_workers=self.jobs, mp_context=context)
        return self._pool


def unfit(analysis: Analysis, env_id: str) -> tuple[str, str] | None:
    """(reason, detail) when checked code cannot serve as environment `env_id`."""
    if analysis.reason:
        return analysis.reason, f"{env_id}: {analysis.detail}"
    env_class = split_env_id(env_id)[1]
    if analysis.env_class != env_class:
        return "wrong env class", f"the source defines {analysis.env_class}, not {env_class}"
    return None
