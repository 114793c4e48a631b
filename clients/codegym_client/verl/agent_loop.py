"""`CodeGymAgentLoop`: a verl agent loop that plays one CodeGym episode per row. Imports verl.

Register it with verl's agent-loop config (`actor_rollout_ref.rollout.agent.agent_loop_config_path`,
read by `AgentLoopWorker`, which instantiates the `_target_` with hydra, passing the entry's other
keys as keyword arguments), e.g. examples/verl/codegym_agent_loop.yaml:

    - name: codegym_agent
      _target_: codegym_client.verl.agent_loop.CodeGymAgentLoop
      target: 127.0.0.1:50051

and give the dataset's rows `agent_name: codegym_agent` and CodeGym's `ability` column (`codegym
export` writes it; verl hands every column of a row to `run()` as a keyword argument). Importing
this module also registers the class as `codegym_agent` (`verl.experimental.agent_loop.register`),
which is enough when the agent loop workers import it themselves.

Built to verl/experimental/agent_loop/agent_loop.py: verl builds one loop instance per row (so the
runtime client is shared per process and event loop, not made per instance), calls
`run(sampling_params, **row)`, and takes an `AgentLoopOutput` whose `reward_score`, when set, is the
row's reward (the reward loop is skipped for it). The episode itself is `run_episode`
(codegym_client/verl/episode.py); model turns go through `server_manager.generate` with one request
id per episode (verl's sticky session: the same server, its prefix cache); tool calls are parsed by
verl's `ToolParser` for `actor_rollout_ref.rollout.multi_turn.format` (hermes, gpt-oss, ...), from
the turn's tokens outside `<think>`.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any
from uuid import uuid4

from codegym_client.requests import DEFAULT_TARGET
from codegym_client.verl.episode import (
    ParseToolCalls,
    Tokenizer,
    ToolCall,
    run_episode,
    shared_client,
    text_tool_parser,
)

__all__ = ["AGENT_NAME", "CodeGymAgentLoop", "verl_tool_parser"]

log = logging.getLogger(__name__)


def _from_verl(module: str, *names: str) -> list[Any]:
    """Objects of verl, imported with this module. verl is the trainer's dependency, not the
    client's: the client's import fence (tests/test_client_install.py) admits no import statement
    of a third-party package, so verl is imported by name."""
    loaded = importlib.import_module(module)
    return [getattr(loaded, name) for name in names]


AgentLoopBase, AgentLoopOutput, register = _from_verl(
    "verl.experimental.agent_loop.agent_loop", "AgentLoopBase", "AgentLoopOutput", "register"
)
(ToolParser,) = _from_verl("verl.experimental.agent_loop.tool_parser", "ToolParser")

AGENT_NAME = "codegym_agent"


def verl_tool_parser(format: str, tokenizer: Tokenizer) -> ParseToolCalls:
    """verl's own parser for `format` (`ToolParser.get_tool_parser`), as `run_episode` takes one."""
    parser = ToolParser.get_tool_parser(format, tokenizer)

    async def parse(ids: list[int]) -> list[ToolCall]:
        _, calls = await parser.extract_tool_calls(ids)
        return [(str(c.name), str(c.arguments)) for c in calls]

    return parse


@register(AGENT_NAME)
class CodeGymAgentLoop(AgentLoopBase):  # type: ignore[misc,valid-type]  # verl is imported by name: Any
    """One CodeGym episode per row, in one runtime session (see the module's docstring).

    Keyword arguments (the agent-loop config entry's keys): `target` (the runtime, `HOST:PORT`),
    `timeout_s` (per runtime call), `max_turns` (model turns; default: the rollout's
    `multi_turn.max_assistant_turns`, else the response length and the env's step cap bound it),
    `max_steps` (the session's step cap; 0: the runtime's), `format` (default: the rollout's
    `multi_turn.format`; `codegym` parses CodeGym's text protocol).

    The row needs `ability`; `raw_prompt` (verl's rendering of the `prompt` column) is the prompt,
    given the session's tools through the chat template (export with `--tools json`, so the prompt
    does not list them a second time). Output: `reward_score` is the environment's final reward;
    `extra_fields` carry `codegym_infrastructure_failure` (drop those rows: the runtime failed, not
    the model), `codegym_failure_reason`, `codegym_stop`, `codegym_done`, `codegym_truncated`,
    `codegym_steps`, `codegym_env_id`. Text only: a processor (vision models) is not used.
    """

    def __init__(
        self,
        trainer_config: Any,
        server_manager: Any,
        tokenizer: Any,
        processor: Any,
        *,
        target: str = DEFAULT_TARGET,
        timeout_s: float = 60.0,
        max_turns: int | None = None,
        max_steps: int = 0,
        format: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(trainer_config, server_manager, tokenizer, processor, **kwargs)
        rollout = self.config.actor_rollout_ref.rollout
        multi_turn = rollout.multi_turn
        self.target = target
        self.timeout_s = timeout_s
        self.response_length = int(rollout.response_length)
        self.max_turns = int(
            max_turns if max_turns is not None else multi_turn.get("max_assistant_turns") or 0
        )
        self.max_steps = max_steps
        self.max_tool_response_length = int(multi_turn.get("max_tool_response_length") or 0)
        self.truncate_side = str(multi_turn.get("tool_response_truncate_side") or "middle")
        self.format = str(format or multi_turn.get("format") or "hermes")

    def _parser(self) -> ParseToolCalls:
        if self.format == "codegym":
            return text_tool_parser("codegym", self.tokenizer)
        return verl_tool_parser(self.format, self.tokenizer)

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> Any:
        ability = kwargs.get("ability")
        if not isinstance(ability, str):
            extra = kwargs.get("extra_info") or {}
            ability = extra.get("ability") if isinstance(extra, dict) else None
        if not isinstance(ability, str):
            raise ValueError("a codegym_agent row needs 'ability' (codegym_v1@{code_id}__{Env}@{config})")
        raw_prompt = kwargs.get("raw_prompt")  # a list, or a numpy array of dicts: no truth test
        messages = [dict(m) for m in raw_prompt] if raw_prompt is not None else []
        request_id = uuid4().hex

        async def generate(prompt_ids: list[int]) -> Any:
            return await self.server_manager.generate(
                request_id=request_id, prompt_ids=prompt_ids, sampling_params=sampling_params
            )

        episode = await run_episode(
            shared_client(self.target, self.timeout_s),
            ability,
            tokenizer=self.tokenizer,
            generate=generate,
            parse_tool_calls=self._parser(),
            messages=messages,
            max_turns=self.max_turns,
            response_length=self.response_length,
            max_tool_response_length=self.max_tool_response_length,
            tool_response_truncate_side=self.truncate_side,
            max_steps=self.max_steps,
            chat_template_kwargs=self.apply_chat_template_kwargs,
        )
        prompt_ids, response_ids, mask = episode.prompt_ids, episode.response_ids, episode.response_mask
        if not prompt_ids:  # the session never opened: the row's prompt, for verl's padding
            prompt_ids = await self.apply_chat_template(messages)
        if not response_ids:  # nothing generated: one masked token, as verl pads an empty response
            response_ids, mask = [int(self.tokenizer.pad_token_id or 0)], [0]
        return AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=response_ids,
            response_mask=mask,
            response_logprobs=episode.response_logprobs,
            reward_score=episode.reward,
            num_turns=episode.num_turns,
            metrics=dict(episode.metrics),
            extra_fields=episode.extra_fields(),
        )
