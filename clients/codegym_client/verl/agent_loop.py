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

Built to verl/experimental/agent_loop/agent_loop.py (run against verl 0.9.1, written for 0.8 too):
verl builds one loop instance per row (so the runtime client is shared per process and event loop,
not made per instance), calls `run(sampling_params, **row)`, and takes an `AgentLoopOutput` whose
`reward_score`, when set, is the row's reward (the reward loop is skipped for it). The episode itself
is `run_episode` (codegym_client/verl/episode.py); model turns go through `server_manager.generate`
with one request id per episode (verl's sticky session: the same server, its prefix cache); tool
calls are parsed by verl's `ToolParser` for `actor_rollout_ref.rollout.multi_turn.format` (hermes,
gpt-oss, qwen3_coder, ...), from the turn's tokens outside `<think>`, given the session's tool
schemas (the XML formats type their arguments by them), and the parser's stop tokens are added to
the sampling parameters as `ToolAgentLoop` adds them. With verl 0.9 the token stream is grown by the
loop's own Continuous Token builder (`ct_build_initial_tokens`, `ct_merge_assistant_token`,
`ct_merge_context_msg`: the model family's boundary tokens, as `ToolAgentLoop` gets them); verl 0.8
has none, and the episode renders with the chat template as 0.8's `ToolAgentLoop` does.

Infrastructure faults. The episode's runtime calls wait out an outage for `outage_wait_s` (10
minutes by default) before they give up; the episodes of a process share the wait (`shared_outage`:
an outage is counted from the first call it failed, so a batch waits it out once). A row they end
(or the session lost) is handed to verl with `codegym_infrastructure_failure` set, reward 0 and a
response mask of zeros: verl multiplies every loss term (policy, KL, entropy) by the mask, so the
row gives no gradient. Its 0 would still enter
its group's baseline under verl's group estimators (they read every row's score, masked or not):
`algorithm.adv_estimator=codegym_grpo` (codegym_client/verl/advantage.py, registered in verl's
driver by a Ray worker setup hook) leaves rows with an all-zero mask out of their group. The loop
logs a warning once per process when the trainer runs one of verl's group estimators directly.
"""

from __future__ import annotations

import inspect
import json
import logging
from typing import Any
from uuid import uuid4

# verl is the trainer's dependency, not the client's (`import codegym_client.verl` does not import
# this module); the client's import fence (tests/test_client_install.py) admits it here.
from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput, register
from verl.experimental.agent_loop.tool_parser import ToolParser
from verl.tools.schemas import OpenAIFunctionToolSchema

from codegym_client.abilities import ABILITY_FORMAT
from codegym_client.outages import DEFAULT_OUTAGE_WAIT_S
from codegym_client.requests import DEFAULT_TARGET
from codegym_client.verl.advantage import GROUPED, PREFIX
from codegym_client.verl.clients import shared_client, shared_outage
from codegym_client.verl.episode import run_episode
from codegym_client.verl.tokens import ChatTemplateRenderer, Renderer, Stream, Tokenizer
from codegym_client.verl.tool_calls import ParseToolCalls, ToolCall, text_tool_parser

__all__ = ["AGENT_NAME", "CodeGymAgentLoop", "verl_tool_parser"]

log = logging.getLogger(__name__)

AGENT_NAME = "codegym_agent"
_warned_estimators: set[str] = set()


def _warn_about_estimator(config: Any) -> None:
    """Once per process and estimator: a group estimator of verl's own would put the 0 of a row an
    infrastructure fault ended into its group's baseline (its gradient is masked either way)."""
    algorithm = config.get("algorithm") if hasattr(config, "get") else None
    name = str(algorithm.get("adv_estimator") or "") if algorithm is not None else ""
    if name in GROUPED and name not in _warned_estimators:
        _warned_estimators.add(name)
        log.warning(
            "algorithm.adv_estimator=%s: a row an infrastructure fault ended gives no gradient (its mask "
            "is zeros), but its reward 0 still enters its group's mean and std; use %s%s "
            "(codegym_client.verl.advantage) to leave it out",
            name,
            PREFIX,
            name,
        )


def experiment_name(config: Any) -> str:
    """verl's name for the run (`trainer.experiment_name`), or "" when the config has none."""
    trainer = config.get("trainer") if hasattr(config, "get") else None
    name = trainer.get("experiment_name") if trainer is not None and hasattr(trainer, "get") else None
    return str(name or "")


def verl_tool_parser(format: str, tokenizer: Tokenizer) -> ParseToolCalls:
    """verl's own parser for `format` (`ToolParser.get_tool_parser`), as `run_episode` takes one.

    verl 0.9's parsers take the tools (`extract_tool_calls(ids, tools)`: the XML formats type the
    arguments by them), 0.8's take ids only. Tools verl's schema model refuses (a parameter with
    no JSON type, as an unannotated one renders) are not given: the parser reads the calls as text."""
    return _parse_with(ToolParser.get_tool_parser(format, tokenizer))


def _parse_with(parser: Any) -> ParseToolCalls:
    """`run_episode`'s parse function over one of verl's `ToolParser` instances."""
    takes_tools = "tools" in inspect.signature(parser.extract_tool_calls).parameters
    schemas: dict[str, Any] = {}

    def verl_schemas(tools: list[dict[str, Any]]) -> Any:
        key = json.dumps(tools, sort_keys=True)
        if key not in schemas:
            try:
                schemas[key] = [OpenAIFunctionToolSchema.model_validate(t) for t in tools]
            except ValueError as exc:  # pydantic's ValidationError is one
                log.warning("verl's tool schema model refuses these tools; parsing without them: %s", exc)
                schemas[key] = None
        return schemas[key]

    async def parse(ids: list[int], tools: list[dict[str, Any]]) -> list[ToolCall]:
        if takes_tools:
            _, calls = await parser.extract_tool_calls(ids, verl_schemas(tools))
        else:
            _, calls = await parser.extract_tool_calls(ids)
        return [(str(c.name), str(c.arguments)) for c in calls]

    return parse


class ContinuousTokenRenderer:
    """The episode's token stream grown by verl 0.9's Continuous Token builder, through the agent
    loop's own `ct_*` methods (the ones `ToolAgentLoop` calls), so boundary tokens (a Qwen newline
    after `<|im_end|>`, ...) are what verl's own loop would produce and carry no loss."""

    def __init__(self, loop: Any) -> None:
        self.loop = loop

    async def prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> Stream:
        return Stream(list(await self.loop.ct_build_initial_tokens(messages, tools=tools)))

    async def model_turn(self, stream: Stream, turn: list[int], logprobs: list[float] | None) -> Stream:
        merged, mask, merged_logprobs = await self.loop.ct_merge_assistant_token(
            stream.token_ids,
            turn,
            stream.mask,
            (stream.logprobs or []) if (stream.logprobs or logprobs) else None,
            assistant_logprobs=list(logprobs) if logprobs else None,
        )
        return Stream(list(merged.token_ids), list(mask), _logprobs(merged_logprobs, stream.logprobs))

    async def messages(
        self,
        stream: Stream,
        previous: list[dict[str, Any]],
        updated: list[dict[str, Any]],
        tools: list[dict[str, Any]],
    ) -> Stream:
        merged, mask, logprobs = await self.loop.ct_merge_context_msg(
            previous, updated, stream.token_ids, stream.mask, stream.logprobs or None, tools=tools
        )
        return Stream(list(merged.token_ids), list(mask), _logprobs(logprobs, stream.logprobs))


def _logprobs(merged: list[float] | None, before: list[float] | None) -> list[float] | None:
    if merged:
        return list(merged)
    return before


@register(AGENT_NAME)
class CodeGymAgentLoop(AgentLoopBase):
    """One CodeGym episode per row, in one runtime session (see the module's docstring).

    Keyword arguments (the agent-loop config entry's keys): `target` (the runtime, `HOST:PORT`),
    `timeout_s` (per runtime call), `max_turns` (model turns; default: the rollout's
    `multi_turn.max_assistant_turns`, else the response length and the env's step cap bound it),
    `max_steps` (the session's step cap; 0: the runtime's), `format` (default: the rollout's
    `multi_turn.format`; `codegym` parses CodeGym's text protocol), `outage_wait_s` (how long a
    runtime call waits out an outage before the row is an infrastructure failure; 600), `run_id`
    (the run the runtime records each episode's outcome for; default: the trainer's
    `trainer.experiment_name`). The rollout's
    `multi_turn.max_user_turns`, `max_tool_response_length` and `tool_response_truncate_side` hold
    as in `ToolAgentLoop`; the caps are checked right after a model turn, whose calls then do not run.

    The row needs `ability`; `raw_prompt` (verl's rendering of the `prompt` column) is the prompt,
    given the session's tools through the chat template (export with `--tools json`, so the prompt
    does not list them a second time). Output: `reward_score` is the environment's final reward;
    `extra_fields` carry `codegym_infrastructure_failure` (the runtime failed, not the model: the
    row's response mask is all zeros and its reward 0), `codegym_failure_reason`, `codegym_stop`,
    `codegym_done`, `codegym_truncated`, `codegym_steps`, `codegym_env_id`. Text only: a processor
    (vision models) is not used.
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
        outage_wait_s: float = DEFAULT_OUTAGE_WAIT_S,
        run_id: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(trainer_config, server_manager, tokenizer, processor, **kwargs)
        _warn_about_estimator(self.config)
        rollout = self.config.actor_rollout_ref.rollout
        multi_turn = rollout.multi_turn
        self.target = target
        self.timeout_s = timeout_s
        self.outage_wait_s = float(outage_wait_s)
        self.run_id = run_id if run_id is not None else experiment_name(self.config)
        self.response_length = int(rollout.response_length)
        self.max_turns = int(
            max_turns if max_turns is not None else multi_turn.get("max_assistant_turns") or 0
        )
        self.max_user_turns = int(multi_turn.get("max_user_turns") or 0)
        self.max_steps = max_steps
        self.max_tool_response_length = int(multi_turn.get("max_tool_response_length") or 0)
        self.truncate_side = str(multi_turn.get("tool_response_truncate_side") or "middle")
        self.format = str(format or multi_turn.get("format") or "hermes")
        # verl's parser for the format, made once as ToolAgentLoop makes its own (none for `codegym`).
        self.tool_parser = (
            None if self.format == "codegym" else ToolParser.get_tool_parser(self.format, tokenizer)
        )

    def _parser(self) -> ParseToolCalls:
        if self.tool_parser is None:
            return text_tool_parser("codegym", self.tokenizer)
        return _parse_with(self.tool_parser)

    def _stop_token_ids(self) -> list[int]:
        """The parser's stop tokens (verl 0.9: e.g. Gemma 4's `<tool_call|>`), which verl's
        `ToolAgentLoop` adds to the sampling parameters so that generation halts after a call."""
        return [int(t) for t in getattr(self.tool_parser, "stop_token_ids", None) or []]

    def _renderer(self) -> Renderer:
        if hasattr(self, "ct_build_initial_tokens"):  # verl >= 0.9
            return ContinuousTokenRenderer(self)
        return ChatTemplateRenderer(self.tokenizer, self.apply_chat_template_kwargs)

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> Any:
        ability = kwargs.get("ability")
        if not isinstance(ability, str):
            extra = kwargs.get("extra_info") or {}
            ability = extra.get("ability") if isinstance(extra, dict) else None
        if not isinstance(ability, str):
            raise ValueError(f"a codegym_agent row needs 'ability' ({ABILITY_FORMAT})")
        raw_prompt = kwargs.get("raw_prompt")  # a list, or a numpy array of dicts: no truth test
        messages = [dict(m) for m in raw_prompt] if raw_prompt is not None else []
        if self.config.actor_rollout_ref.rollout.get("full_determinism"):
            request_id = f"det-{int(kwargs.get('priority') or 0)}"  # as verl's ToolAgentLoop names it
        else:
            request_id = uuid4().hex
        stop = self._stop_token_ids()
        if stop:
            merged_stop = set(sampling_params.get("stop_token_ids") or []) | set(stop)
            sampling_params = {**sampling_params, "stop_token_ids": sorted(merged_stop)}
        preempted: list[int] = []

        async def generate(prompt_ids: list[int]) -> Any:
            output = await self.server_manager.generate(
                request_id=request_id, prompt_ids=prompt_ids, sampling_params=sampling_params
            )
            if getattr(output, "num_preempted", None) is not None:
                preempted.append(int(output.num_preempted))
            return output

        renderer = self._renderer()
        episode = await run_episode(
            shared_client(self.target, self.timeout_s),
            ability,
            tokenizer=self.tokenizer,
            generate=generate,
            parse_tool_calls=self._parser(),
            messages=messages,
            max_turns=self.max_turns,
            max_user_turns=self.max_user_turns,
            response_length=self.response_length,
            max_tool_response_length=self.max_tool_response_length,
            tool_response_truncate_side=self.truncate_side,
            max_steps=self.max_steps,
            chat_template_kwargs=self.apply_chat_template_kwargs,
            renderer=renderer,
            outage_wait_s=self.outage_wait_s,
            outage=shared_outage(self.target, self.outage_wait_s),  # one wait for the process's episodes
            run_id=self.run_id,
            # No policy version: verl 0.9.1 gives an agent loop no step. The trainer's
            # `global_steps` reaches the agent-loop worker as `meta_info` of the batch, which
            # `AgentLoopWorker.generate_sequences` uses for tracing and does not pass to `run()`
            # (only the row's columns); the rollout server reports the weights' step with each
            # generated turn (`TokenOutput.extra_fields["global_steps"]`), but the session is
            # created before the first turn, with the tools the prompt needs.
        )
        prompt_ids, response_ids, mask = episode.prompt_ids, episode.response_ids, episode.response_mask
        if not prompt_ids:  # the session never opened: the row's prompt, for verl's padding
            prompt_ids = (await renderer.prompt(messages, [])).token_ids
        if not response_ids:  # nothing generated: one masked token, as verl pads an empty response
            response_ids, mask = [int(self.tokenizer.pad_token_id or 0)], [0]
        if episode.infrastructure_failure:
            # The runtime failed, not the model: the row keeps its tokens (for verl's logs and
            # traces) but none is trained on, and the group estimators codegym_* leave it out.
            mask = [0] * len(response_ids)
        metrics: dict[str, Any] = dict(episode.metrics)
        if preempted:
            metrics["num_preempted"] = sum(preempted)
        return AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=response_ids,
            response_mask=mask,
            response_logprobs=episode.response_logprobs,
            reward_score=episode.reward,
            num_turns=episode.num_turns,
            metrics=metrics,
            extra_fields=episode.extra_fields(),
        )
