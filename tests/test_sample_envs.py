"""Every sample environment reaches reward 1 with its own solve() on every task config, and
every install of the server distribution carries them (they are `codegym up`'s default library).

Env code is untrusted even when we wrote it, so it runs in a child interpreter, never in the
test process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import zipfile
from collections import defaultdict
from pathlib import Path

import pytest

from tests.conftest import ENV_DIR, PYTHON, ROOT, SAMPLES, sample_env_paths, sample_tasks

# What the server distribution is built from (the Dockerfile copies the same).
SERVER_SOURCES = (
    "pyproject.toml",
    "README.md",
    "codegym",
    "codegym_jobs",
    "codegym_cli",
    "services",
    "sandbox_worker",
)

# Run from a non-editable install: `codegym up`'s first-run library, built from the installed samples.
BUILD_DEFAULT = """
import json, sys
from pathlib import Path
import codegym.samples
from codegym.library.store import Library
from codegym_cli.up import build_default_library

assert codegym.samples.__file__.startswith(sys.argv[1]), codegym.samples.__file__
build_default_library(Path("lib.db"))
with Library("lib.db", read_only=True) as library:
    print(json.dumps(library.counts()))
"""

RUNNER = r"""
import importlib.util, json, sys
path, class_name = sys.argv[1], sys.argv[2]
spec = importlib.util.spec_from_file_location("env_under_test", path)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
cls = getattr(module, class_name)
for line in sys.stdin:
    config = json.loads(line)
    env = cls.from_env_str(class_name + "@" + json.dumps(config))
    final = env.solve()
    print(json.dumps({"reward": env.reward, "steps": env.step_count, "final": final}))
"""


def test_every_env_has_problem_task_text_and_three_difficulties() -> None:
    problems = {json.loads(x)["question_id"] for x in (SAMPLES / "problems.jsonl").read_text().splitlines()}
    levels: dict[str, set[str]] = defaultdict(set)
    for task in sample_tasks():
        levels[task["env_id"]].add(task["difficulty"])
    for path in sample_env_paths():
        env_id = path.stem
        assert env_id.split("__")[0] in problems
        assert levels[env_id] == {"easy", "medium", "hard"}, env_id
        assert (ENV_DIR / f"{env_id}.task.md").read_text().strip()


def test_solve_reaches_reward_one_on_every_config() -> None:
    by_env: dict[str, list[dict]] = defaultdict(list)
    for task in sample_tasks():
        by_env[task["env_id"]].append(task["config"])
    assert len(by_env) >= 12
    for env_id, configs in by_env.items():
        stdin = "".join(json.dumps(c) + "\n" for c in configs)
        proc = subprocess.run(
            [PYTHON, "-c", RUNNER, str(ENV_DIR / f"{env_id}.py"), env_id.split("__")[1]],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
        results = [json.loads(line) for line in proc.stdout.splitlines()]
        assert len(results) == len(configs)
        for config, result in zip(configs, results, strict=True):
            assert result["reward"] == 1.0, (env_id, config, result)
            assert 1 < result["steps"] <= 256, (env_id, config, result)


@pytest.mark.slow  # builds and installs the server distribution
def test_a_non_editable_install_carries_the_sample_environments(tmp_path: Path) -> None:
    """The wheel holds every sample file, and `codegym up` builds its default library from an
    install of it alone (no checkout beside it): the samples are package data, not a folder of
    the checkout that only an editable install can see."""
    source = tmp_path / "src"  # a copy as a fresh clone has it: the build writes nothing into the checkout
    source.mkdir()
    for name in SERVER_SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(
                ROOT / name,
                source / name,
                ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build"),
            )
        else:
            shutil.copy2(ROOT / name, source / name)
    pip = [PYTHON, "-m", "pip", "--disable-pip-version-check", "-q"]
    built = subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", str(source), "-w", str(tmp_path / "wheels")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp_path / "wheels").glob("codegym-*.whl")
    samples = [*ENV_DIR.glob("*.py"), *ENV_DIR.glob("*.task.md"), *SAMPLES.glob("*.jsonl")]
    assert len(samples) == 2 * len(sample_env_paths()) + 3
    wanted = {f"codegym/samples/{p.relative_to(SAMPLES).as_posix()}" for p in samples}
    # The jail's package too: the worker mounts it from the installed copy.
    inside = ROOT / "codegym" / "inside"
    wanted |= {f"codegym/inside/{p.name}" for p in inside.glob("*.py")}
    assert len(wanted) > len(samples)
    assert wanted <= set(zipfile.ZipFile(wheel).namelist())

    site = tmp_path / "site"
    installed = subprocess.run(
        [*pip, "install", "--no-deps", "--target", str(site), str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert installed.returncode == 0, installed.stderr[-3000:]
    run = tmp_path / "run"
    run.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}  # before the venv's editable checkout
    played = subprocess.run(
        [PYTHON, "-c", BUILD_DEFAULT, str(site)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=run,
        env=env,
    )
    assert played.returncode == 0, played.stderr[-3000:]
    envs, tasks = json.loads(played.stdout.strip().splitlines()[-1])
    assert (envs, tasks) == (len(sample_env_paths()), len(sample_tasks()))
