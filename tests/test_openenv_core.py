"""The OpenEnv gateway with the clients of `openenv-core` 0.3.0, the OpenEnv release TRL's
experimental OpenEnv harness imports (`openenv.core.harness`); tests/test_openenv.py runs the same
gateway with the newer `openenv` 0.10.0 in the project's venv. Two releases of one module cannot
share a venv, so this file runs in the trainers' venv (`make test-trainers`), against a gateway and
runtime started from the project's venv (tests/helpers/with_runtime.py --openenv). Elsewhere it
skips; `CODEGYM_TESTS_REQUIRE_TRAINERS=1` turns that skip into a failure."""

from __future__ import annotations

import importlib.util
import os
from importlib import metadata

import pytest

REQUIRED = os.environ.get("CODEGYM_TESTS_REQUIRE_TRAINERS") == "1"
GATEWAY = os.environ.get("CODEGYM_TEST_OPENENV", "").strip()
if importlib.util.find_spec("openenv") is None or not GATEWAY:
    why = "needs openenv-core and CODEGYM_TEST_OPENENV (run `make test-trainers`)"
    if REQUIRED:
        raise RuntimeError(f"CODEGYM_TESTS_REQUIRE_TRAINERS=1: this file {why}")
    pytest.skip(why, allow_module_level=True)

from openenv.core.generic_client import GenericEnvClient  # noqa: E402
from openenv.core.mcp_client import MCPToolClient  # noqa: E402

from tests.helpers.openenv_play import play_tool_calls, rows  # noqa: E402


def test_the_release_is_the_one_trl_uses() -> None:
    assert metadata.version("openenv-core") == "0.3.0"


async def test_generic_client_plays_rows_to_reward_1() -> None:
    for row, steps in rows(3):
        async with GenericEnvClient(base_url=GATEWAY) as env:
            result = await env.reset(**row)
            assert result.done is False and result.reward is None
            names = {t["name"] for t in result.observation["tools"]}
            for i, (action, expected) in enumerate(steps):
                assert action["name"] in names
                step = (
                    {"type": "call_tool", "tool_name": action["name"], "arguments": action["parameters"]}
                    if i % 2
                    else action
                )
                result = await env.step(step)
                assert result.observation["result"] == expected  # the env's observation, unchanged
                last = i == len(steps) - 1
                assert result.done is last and result.reward == (1.0 if last else None)
            assert (await env.state())["step_count"] == len(steps)


async def test_mcp_tool_client_lists_the_tools_and_plays_to_reward_1() -> None:
    for row, steps in rows(2):
        async with MCPToolClient(base_url=GATEWAY) as env:
            await env.reset(**row)
            tools = await env.list_tools(use_cache=False)
            assert {t.name for t in tools} >= {a["name"] for a, _ in steps}
            first, expected = steps[0]
            assert await env.call_tool(first["name"], **first["parameters"]) == expected
            assert await play_tool_calls(env, steps[1:]) == 1.0
