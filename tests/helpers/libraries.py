"""SQLite environment libraries for the tests that serve one, built from the samples and the test
fixture environments.

A module's `library` fixture is `library_fixture(...)` with what it imports; `build_library` is the
same build for a fixture that then changes the library, or for a test body.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest

from codegym.library.store import Library
from codegym.samples import ENVS, TASKS
from tests.helpers.servers import Scope

# The sample environments and their task configs: the library `codegym up` builds and serves.
SAMPLE_LIBRARY: tuple[Path, ...] = (ENVS, TASKS)


def build_library(path: Path, *imports: Iterable[Path]) -> Path:
    """A library at `path` holding `imports`, each one `Library.import_paths` (in order, as the
    tests that import a fixture env after the samples always have). A source the import skipped
    fails here, where the cause is plain, rather than as an env missing from the runtime later."""
    with Library(path) as library:
        for paths in imports:
            report = library.import_paths(paths)
            assert report.skipped == [], report.skipped
    return path


def library_fixture(*imports: Iterable[Path], scope: Scope = "module") -> Callable[..., Any]:
    """A pytest fixture of `build_library(..., *imports)`, for a module to bind to its fixture's
    name (`library = library_fixture(SAMPLE_LIBRARY)`): a library in a fresh temporary folder of
    its own, the test's `tmp_path` when function-scoped."""
    batches = [list(paths) for paths in imports]

    def library(request: pytest.FixtureRequest) -> Path:
        if scope == "function":
            folder: Path = request.getfixturevalue("tmp_path")
        else:
            folder = request.getfixturevalue("tmp_path_factory").mktemp("library")
        return build_library(folder / "library.db", *batches)

    return pytest.fixture(scope=scope)(library)
