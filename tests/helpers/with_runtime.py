"""Run a command against a runtime serving the sample library: `python -m tests.helpers.with_runtime
[--openenv] -- COMMAND...` starts a sandbox worker and a runtime (this interpreter's `codegym`), and
with `--openenv` an OpenEnv gateway in front of it, runs COMMAND with `CODEGYM_TEST_RUNTIME` set to
the runtime's address (and `CODEGYM_TEST_OPENENV` to the gateway's URL), stops them all by pid and
exits with COMMAND's status.

Why: `make test-trainers` runs tests/test_verl_real.py, tests/test_trl_real.py and
tests/test_openenv_core.py in a venv of its own (verl, TRL, openenv-core and torch beside the client
only), which cannot start our servers; they run from the project's venv, as a trainer's rollout
workers would reach a deployed runtime.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from codegym.library.store import Library
from tests.conftest import ENV_DIR, SAMPLES
from tests.helpers.servers import RUNTIME_SWITCH, CodegymServer, start_runtime, start_workers

OPENENV_SWITCH = "CODEGYM_TEST_OPENENV"


def main(argv: list[str]) -> int:
    openenv = argv[:1] == ["--openenv"]
    if openenv:
        argv = argv[1:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("usage: python -m tests.helpers.with_runtime [--openenv] -- COMMAND...", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="codegym-with-runtime-") as folder:
        library = Path(folder) / "library.db"
        with Library(library) as lib:
            lib.import_paths([ENV_DIR, SAMPLES / "tasks.jsonl"])
        workers = start_workers(count=1)
        try:
            runtime = start_runtime(library, workers)
            gateway = None
            try:
                env = {**os.environ, RUNTIME_SWITCH: runtime.address}
                if openenv:
                    gateway = CodegymServer(["serve", "openenv", "--runtime", runtime.address, "--port", "0"])
                    env[OPENENV_SWITCH] = f"http://{gateway.address}"
                return subprocess.run(argv, env=env, check=False).returncode
            finally:
                if gateway is not None:
                    gateway.stop()
                runtime.stop()
        finally:
            for worker in workers:
                worker.stop()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
