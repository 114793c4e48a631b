"""Every sample environment reaches reward 1 with its own solve() on every task config.

Env code is untrusted even when we wrote it, so it runs in a child interpreter, never in the
test process.
"""

from __future__ import annotations

import json
import subprocess
from collections import defaultdict

from tests.conftest import ENV_DIR, EXAMPLES, PYTHON, sample_env_paths, sample_tasks

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
    problems = {json.loads(x)["question_id"] for x in (EXAMPLES / "problems.jsonl").read_text().splitlines()}
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
