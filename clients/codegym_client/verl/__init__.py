"""verl adapter: CodeGym episodes as a verl agent loop (and tools for verl's `ToolAgentLoop`).

    # examples/verl/codegym_agent_loop.yaml, given as actor_rollout_ref.rollout.agent.agent_loop_config_path
    - name: codegym_agent
      _target_: codegym_client.verl.agent_loop.CodeGymAgentLoop
      target: 127.0.0.1:50051

Modules, so that importing this package needs neither verl nor torch:

- `episode`: `run_episode`, one episode as a plain async function (tokenizer, a `generate`
  callable and an `AsyncRuntimeClient` in; token ids, response mask, reward and flags out). No verl.
- `tool_calls`: a turn's tool calls read without verl (`text_tool_parser`: hermes or CodeGym's
  text protocol, outside `<think>`, `visible_text`). No verl.
- `tokens`: the episode's token stream (`Stream`) and how it grows (`Renderer`;
  `ChatTemplateRenderer`, verl 0.8's way). No verl.
- `clients`: `shared_client`, one runtime client per target and event loop. No verl.
- `agent_loop`: `CodeGymAgentLoop(AgentLoopBase)`, registered as `codegym_agent`. Imports verl.
- `tool`: `CodeGymTool(BaseTool)`, for `ToolAgentLoop` users, keyed by request id; its docstring
  lists its limits. Imports verl.
- `advantage`: `register()` adds `codegym_grpo` (and the other group estimators) to verl's
  registry: verl's estimator without the rows an infrastructure fault ended (mask all zeros), so
  they do not shift their group's baseline. Imports verl when `register()` runs.

`CodeGymAgentLoop`, `CodeGymTool` and `verl_tool_parser` are importable from here too, on first
use (which imports verl).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from codegym_client.errors import INFRASTRUCTURE_REASONS
from codegym_client.requests import DEFAULT_TARGET
from codegym_client.verl.clients import shared_client
from codegym_client.verl.episode import Episode, Generate, run_episode
from codegym_client.verl.tokens import Tokenizer
from codegym_client.verl.tool_calls import ParseToolCalls, text_tool_parser, visible_text

if TYPE_CHECKING:
    from codegym_client.verl.agent_loop import AGENT_NAME, CodeGymAgentLoop, verl_tool_parser
    from codegym_client.verl.tool import CodeGymTool

__all__ = [
    "AGENT_NAME",
    "INFRASTRUCTURE_REASONS",
    "CodeGymAgentLoop",
    "CodeGymTool",
    "Episode",
    "Generate",
    "ParseToolCalls",
    "Tokenizer",
    "run_episode",
    "shared_client",
    "text_tool_parser",
    "tool_config",
    "verl_tool_parser",
    "visible_text",
]

_LAZY = {
    "AGENT_NAME": "agent_loop",
    "CodeGymAgentLoop": "agent_loop",
    "verl_tool_parser": "agent_loop",
    "CodeGymTool": "tool",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def tool_config(
    schemas: list[dict[str, Any]], target: str = DEFAULT_TARGET, run_id: str = ""
) -> dict[str, Any]:
    """verl's tool config (the YAML of `multi_turn.tool_config_path`) giving one `CodeGymTool`
    per tool schema of one environment (`[json.loads(t.json_schema) for t in get_env(id).tools]`);
    `run_id` names the run the runtime records the episodes for."""
    config: dict[str, Any] = {"type": "native", "target": target}
    if run_id:
        config["run_id"] = run_id
    return {
        "tools": [
            {
                "class_name": "codegym_client.verl.tool.CodeGymTool",
                "config": dict(config),
                "tool_schema": schema,
            }
            for schema in schemas
        ]
    }
