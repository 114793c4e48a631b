"""The sample environments and their data, shipped inside the server distribution (package data).

They are runtime data, not documentation: `codegym up` builds its default library from `envs/`
and `tasks.jsonl`, `codegym demo` replays `trajectories.jsonl`, and the synthesis prompts' worked
example is `envs/Sample_0006_I__ArrayGcdEnv.py` with its problem (`problems.jsonl`) and task
configs. Kept in a package so that every install has them, editable or not, and the paths below
are where the installed package is.

- `envs/`: the environments (`{code_id}__{Env}.py`, each with its task text `.task.md`);
- `tasks.jsonl`: task configs of them (`env_id`, `config`, `difficulty`);
- `problems.jsonl`: the raw problems they were made from (`codegym synthesize --problems`);
- `trajectories.jsonl`: recorded oracle play of the task configs (first observation, steps).
"""

from __future__ import annotations

from pathlib import Path

SAMPLES = Path(__file__).resolve().parent
ENVS = SAMPLES / "envs"
TASKS = SAMPLES / "tasks.jsonl"
PROBLEMS = SAMPLES / "problems.jsonl"
TRAJECTORIES = SAMPLES / "trajectories.jsonl"
