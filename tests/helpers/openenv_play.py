"""Recorded oracle episodes played through OpenEnv's clients, shared by the gateway's tests with
`openenv` 0.10 (tests/test_openenv.py, the project's venv) and with `openenv-core` 0.3.0
(tests/test_openenv_core.py, the trainers' venv): the same module path in both releases."""

from __future__ import annotations

import json
from typing import Any

from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation

from codegym_testkit.trainer_script import TRAJECTORIES, ability

Step = tuple[dict[str, Any], str]  # (the action, its recorded observation)


def rows(count: int) -> list[tuple[dict[str, Any], list[Step]]]:
    """Training-instance rows (the `ability` column and the rest) of recorded oracle episodes of
    `count` distinct environments, with their actions and observations."""
    seen: set[str] = set()
    out: list[tuple[dict[str, Any], list[Step]]] = []
    for t in TRAJECTORIES:
        if t["env_id"] in seen or t["reward"] != 1.0 or len(t["steps"]) > 30:
            continue
        seen.add(t["env_id"])
        row = {
            "ability": ability(t),
            "answer": "There is no answer",
            "data_source": "codegym_gym_v1",
            "prompt": [{"role": "user", "content": "..."}],
            "extra_info": {"index": str(len(out))},
        }
        out.append((row, [(json.loads(action), observation) for action, observation in t["steps"]]))
        if len(out) == count:
            break
    assert len(out) == count, f"only {len(out)} recorded episodes qualify"
    return out


async def play_tool_calls(env: Any, steps: list[Step]) -> float:
    """Each step as an MCP `CallToolAction` (what verifiers sends); every observation must be the
    recorded one and the last step must end the episode. Returns the summed step rewards."""
    total = 0.0
    result = None
    for action, expected in steps:
        result = await env.step(CallToolAction(tool_name=action["name"], arguments=action["parameters"]))
        assert isinstance(result.observation, CallToolObservation)
        assert result.observation.result == expected
        total += result.reward or 0.0
    assert result is not None and result.done
    return total
