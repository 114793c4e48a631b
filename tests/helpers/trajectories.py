"""Record oracle trajectories of environments in a child interpreter (env code stays out of the tests).

Run as a script: reads `{"path", "class", "config"}` lines on stdin and prints one JSON line per
input: the first observation, then each (action, observation) of the env's own solve(), the reward.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

RECORDER = r"""
import importlib.util, json, sys
modules = {}
for line in sys.stdin:
    job = json.loads(line)
    if job["path"] not in modules:
        spec = importlib.util.spec_from_file_location("env_%d" % len(modules), job["path"])
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        modules[job["path"]] = module
    cls = getattr(modules[job["path"]], job["class"])
    env = cls.from_env_str(job["class"] + "@" + json.dumps(job["config"]))
    first = env.reset(job["config"])
    steps = []
    real_step = env.step
    def recording_step(action, real_step=real_step, steps=steps):
        out = real_step(action)
        steps.append([action, out[1]])
        return out
    env.step = recording_step
    env.solve()
    print(json.dumps({"first": first, "steps": steps, "reward": env.reward}), flush=True)
"""


def record(jobs: list[dict[str, Any]], python: str = sys.executable) -> list[dict[str, Any]]:
    stdin = "".join(json.dumps(j) + "\n" for j in jobs)
    proc = subprocess.run(
        [python, "-c", RECORDER],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONHASHSEED": "0", "PATH": "/usr/bin:/bin"},
    )
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr)
    return [json.loads(line) for line in proc.stdout.splitlines()]
