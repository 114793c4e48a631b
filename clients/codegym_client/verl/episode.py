"""One CodeGym episode as verl's agent loops play one: token ids in, token ids out. No verl here.

`run_episode` is the whole episode of `CodeGymAgentLoop` as a plain async function, so it runs (and
is tested) without verl or torch: a tokenizer with a chat template, a `generate` callable (verl's
`server_manager.generate` bound to a request id) and an `AsyncRuntimeClient` in; prompt ids,
response ids, the response mask, the reward and the episode's flags out.

It builds the trajectory the way verl's `ToolAgentLoop` does (verl/experimental/agent_loop/
tool_agent_loop.py), through a `Renderer` (codegym_client/verl/tokens.py): one token stream (the
prompt, then each model turn's tokens as generated, mask 1, then each turn's tool messages, mask 0,
log-prob 0.0). verl 0.9 grows that stream with its Continuous Token builder (`CodeGymAgentLoop`
hands its own to the episode); `ChatTemplateRenderer`, the default, is verl 0.8's way: the tool
messages rendered with the chat template alone, the system prompt's tokens cut off. The episode
stops when the model calls no tool, after `max_turns` model turns (that turn's calls are not run, as
verl's loop does not run them) or `max_user_turns` tool-message turns, or when the response would
pass `response_length` (a turn's tool messages that would pass it are not appended). What it adds:

- one runtime session for the whole episode (opened from the row's `ability`, closed in `finally`),
  every tool call a step of it; the episode also stops when the environment ends it (done or
  truncated), right after the model's final call;
- tool calls read from the turn's text outside `<think>...</think>` (verl's hermes parser reads them
  anywhere, so a call the model only thought about would be run; codegym_client/verl/tool_calls.py);
- `reward` is the environment's final reward (1.0 for a right answer);
- an outage is waited out: creating the session, each step (sent with its step index, so that a
  resend the runtime already applied is answered from its record, never applied twice) and the
  close go through an `Outage` clock (codegym_client/outages.py) for `outage_wait_s` (10 minutes
  by default), with back-off and a log line saying what they wait for, while the failure is one
  that clears by itself (the runtime unavailable or full, the way to it broken);
- an infrastructure fault that does not clear (the session lost, a step refused: by the step rule,
  `codegym_client.errors.STEP_FAULTS`, a failed step is never the model's) or outlasts the wait
  ends the episode with `infrastructure_failure` set and its reason: the fault's text is never a
  tool message, so it never reaches the model or the trajectory.

The episode is a `_Play`: its session opened (`open`), then model turns (`model_turn`: generate,
decode off the event loop, parse the calls) and tool calls (`tool_calls`: one step each, then
`append` their messages) in turn until one of them stops it, then `finish` and `close`.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from codegym_client.api.runtime.v1 import runtime_service_pb2 as rt
from codegym_client.async_client import AsyncRuntimeClient
from codegym_client.errors import STEP_FAULTS, CodeGymError, is_infrastructure
from codegym_client.outages import DEFAULT_OUTAGE_WAIT_S, Outage
from codegym_client.verl.tokens import ChatTemplateRenderer, Renderer, Stream, Tokenizer, as_ids
from codegym_client.verl.tool_calls import ParseToolCalls, ToolCall, text_tool_parser, visible_text

__all__ = ["Episode", "Generate", "run_episode"]

log = logging.getLogger(__name__)

Generate = Callable[[list[int]], Awaitable[Any]]  # prompt ids -> an object with token_ids (+ log_probs)


@dataclass
class Episode:
    """A played episode: verl's `AgentLoopOutput` fields, and what CodeGym adds as extra fields."""

    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)  # 1: model tokens, 0: tool messages
    response_logprobs: list[float] | None = None
    reward: float = 0.0
    done: bool = False
    truncated: bool = False
    steps: int = 0
    assistant_turns: int = 0
    user_turns: int = 0
    stop: str = (
        ""  # done, truncated, no_tool_call, max_turns, max_user_turns, response_length, infrastructure
    )
    infrastructure_failure: bool = False
    failure_reason: str = ""
    env_id: str = ""
    session_id: str = ""
    messages: list[dict[str, Any]] = field(default_factory=list)  # the conversation, for logs
    metrics: dict[str, float] = field(default_factory=lambda: {"generate_sequences": 0.0, "tool_calls": 0.0})

    @property
    def num_turns(self) -> int:
        """Chat turns, counted as verl's ToolAgentLoop counts them (user + assistant + 1)."""
        return self.user_turns + self.assistant_turns + 1

    def extra_fields(self) -> dict[str, Any]:
        """What `CodeGymAgentLoop` puts in `AgentLoopOutput.extra_fields` (one column each in
        verl's batch). A row with `codegym_infrastructure_failure` is handed to verl with a
        response mask of zeros (`CodeGymAgentLoop.run`): no gradient from it."""
        return {
            "codegym_infrastructure_failure": self.infrastructure_failure,
            "codegym_failure_reason": self.failure_reason,
            "codegym_stop": self.stop,
            "codegym_done": self.done,
            "codegym_truncated": self.truncated,
            "codegym_steps": self.steps,
            "codegym_env_id": self.env_id,
        }


def _truncate(text: str, limit: int, side: str) -> str:
    """verl's tool-response truncation (`max_tool_response_length`, `tool_response_truncate_side`)."""
    if limit <= 0 or len(text) <= limit:
        return text
    if side == "left":
        return text[:limit] + "...(truncated)"
    if side == "right":
        return "(truncated)..." + text[-limit:]
    half = limit // 2
    return text[:half] + "...(truncated)..." + text[-half:]


async def run_episode(
    client: AsyncRuntimeClient,
    ability: str,
    *,
    tokenizer: Tokenizer,
    generate: Generate,
    parse_tool_calls: ParseToolCalls | None = None,
    messages: Sequence[Mapping[str, Any]] | None = None,
    max_turns: int = 0,
    max_user_turns: int = 0,
    response_length: int = 8192,
    max_tool_response_length: int = 0,
    tool_response_truncate_side: str = "middle",
    max_calls_per_turn: int = 1,
    max_steps: int = 0,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    renderer: Renderer | None = None,
    outage_wait_s: float = DEFAULT_OUTAGE_WAIT_S,
    run_id: str = "",
    policy_version: int | None = None,
    outage: Outage | None = None,
) -> Episode:
    """Play one episode of `ability` (`codegym_v1@{code_id}__{Env}@{config}`) in one session.

    - `messages`: the prompt (verl's `raw_prompt`; `codegym export --tools json` writes one without
      the text protocol). Without it, one user message: the task and the first observation.
      The tools given to the chat template are the session's own (`CreateSession`'s JSON schemas).
    - `generate(prompt_ids)`: one model turn; returns an object with `token_ids` and optionally
      `log_probs` (verl's `TokenOutput`).
    - `parse_tool_calls(ids, tools)`: the turn's calls as (name, arguments JSON), given the turn's
      tokens outside `<think>` and the session's tool schemas; default: the hermes format, parsed
      as verl's `HermesToolParser` does.
    - `max_turns`: model turns at most (0: no limit but the response length and the env's step
      cap); `max_user_turns`: tool-message turns at most. Checked right after a model turn, before
      its calls are parsed, as verl's `ToolAgentLoop` checks `max_assistant_turns` and
      `max_user_turns`: the turn that reaches a cap is the response's end, its calls not run.
    - `max_calls_per_turn`: calls of one turn that are stepped, in order (the environment is one
      state: they are steps one after the other; the default, 1, is CodeGym's one call per step).
    - `renderer`: how the token stream grows (default: `ChatTemplateRenderer(tokenizer,
      chat_template_kwargs)`).
    - `outage_wait_s`: how long each runtime call waits out a failure that clears by itself before
      the episode ends as an infrastructure failure (the operator's setting; 0: the client's own
      resends only). `outage`: a clock shared with other episodes (`CodeGymAgentLoop` shares one
      per process and runtime: an outage is waited out once, not once per episode); without it,
      the episode's calls share one of their own.
    - `run_id`, `policy_version`: the trainer's run and the policy's version, which the runtime
      records with the episode's outcome (`Stats`, `SampleTasks`).
    """
    play = _Play(
        client=client,
        tokenizer=tokenizer,
        generate=generate,
        parse=parse_tool_calls or text_tool_parser("hermes", tokenizer),
        render=renderer or ChatTemplateRenderer(tokenizer, chat_template_kwargs),
        outage=outage or Outage(outage_wait_s),
        max_turns=max_turns,
        max_user_turns=max_user_turns,
        response_length=response_length,
        max_tool_response_length=max_tool_response_length,
        truncate_side=tool_response_truncate_side,
        calls_per_turn=max(1, max_calls_per_turn),
    )
    episode = play.episode
    try:
        created = await play.open(ability, max_steps, run_id, policy_version)
        if created is None:
            return episode
        conversation = [dict(m) for m in messages or ()]
        if not conversation:
            first = (
                f"{created.task_text}\n\n{created.observation}" if created.observation else created.task_text
            )
            conversation = [{"role": "user", "content": first}]
        episode.messages = conversation
        play.stream = await play.render.prompt(list(conversation), play.tools)
        while not episode.stop:
            calls = await play.model_turn()
            if episode.stop:
                break
            tool_messages = await play.tool_calls(calls)
            if episode.stop:
                break  # an outage: nothing from it is appended; an ended episode: the model's call is last
            await play.append(tool_messages)
        play.finish()
        return episode
    finally:
        await play.close(outage_wait_s)


@dataclass
class _Play:
    """An episode being played: what its model turns and tool calls share (the session, the token
    stream, the session's step index), and one method for each part of the episode."""

    client: AsyncRuntimeClient
    tokenizer: Tokenizer
    generate: Generate
    parse: ParseToolCalls
    render: Renderer
    outage: Outage
    max_turns: int
    max_user_turns: int
    response_length: int
    max_tool_response_length: int
    truncate_side: str
    calls_per_turn: int
    episode: Episode = field(default_factory=Episode)
    stream: Stream = field(default_factory=lambda: Stream([]))
    tools: list[dict[str, Any]] = field(default_factory=list)
    step_index: int = 0  # the session's step index: what its next step applies to

    async def open(
        self, ability: str, max_steps: int, run_id: str, policy_version: int | None
    ) -> rt.CreateSessionResponse | None:
        """The episode's session, or None when the infrastructure failed it (the episode says so). A
        failure that is not the infrastructure's (the row is wrong: an unknown env, a config its env
        cannot start) is raised: it fails the same way again."""
        try:
            created = await self.outage.call_async(
                lambda: self.client.create_session(
                    ability=ability, max_steps=max_steps, run_id=run_id, policy_version=policy_version
                ),
                f"CodeGym CreateSession ({ability[:200]})",
            )
        except grpc.RpcError as exc:
            if not is_infrastructure(exc):
                raise
            _failed(self.episode, "CreateSession", exc)
            return None
        self.episode.session_id, self.episode.env_id = created.session_id, created.env_id
        self.tools = [json.loads(t.json_schema) for t in created.tools]
        return created

    async def model_turn(self) -> list[ToolCall]:
        """One model turn, appended to the stream and the conversation; its calls to run (at most
        `calls_per_turn`). Sets the episode's stop when the turn reaches a cap (its calls are not
        run) or calls no tool."""
        episode = self.episode
        started = time.monotonic()
        output = await self.generate(list(self.stream.token_ids))
        episode.metrics["generate_sequences"] += time.monotonic() - started
        turn = [int(i) for i in output.token_ids]
        episode.assistant_turns += 1
        self.stream = await self.render.model_turn(self.stream, turn, getattr(output, "log_probs", None))
        capped = self.cap()
        loop = asyncio.get_running_loop()
        if capped:
            text = await loop.run_in_executor(None, _decode, self.tokenizer, turn)
            episode.messages.append({"role": "assistant", "content": text})
            episode.stop = capped
            return []
        text, visible = await loop.run_in_executor(None, _read_turn, self.tokenizer, turn)
        calls = (await self.parse(visible, self.tools))[: self.calls_per_turn]
        episode.messages.append(_assistant_message(text, calls))
        if not calls:
            episode.stop = "no_tool_call"
        return calls

    def cap(self) -> str:
        """The cap the response has reached after a model turn, or ""."""
        if len(self.stream.mask) >= self.response_length:
            return "response_length"
        if self.max_turns and self.episode.assistant_turns >= self.max_turns:
            return "max_turns"
        if self.max_user_turns and self.episode.user_turns >= self.max_user_turns:
            return "max_user_turns"
        return ""

    async def tool_calls(self, calls: list[ToolCall]) -> list[dict[str, Any]]:
        """The turn's calls, each a step of the session, in order; their tool messages. Sets the
        episode's stop when the environment ends the episode or a step fails (the step rule)."""
        episode = self.episode
        tool_messages: list[dict[str, Any]] = []
        started = time.monotonic()
        for name, arguments in calls:
            action = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
            try:  # with its index: a resend the runtime applied already is answered, not applied
                result = await self.outage.call_async(
                    functools.partial(
                        self.client.step, episode.session_id, action, step_index=self.step_index
                    ),
                    f"CodeGym Step {self.step_index} of session {episode.session_id}",
                )
            except STEP_FAULTS as exc:  # the step rule (errors.py): never the model's doing
                _failed(episode, "Step", exc)
                break
            self.step_index = int(result.step_index)
            episode.steps += 1
            episode.reward = float(result.reward)
            content = _truncate(str(result.observation), self.max_tool_response_length, self.truncate_side)
            tool_messages.append({"role": "tool", "content": content})
            if result.done or result.truncated:
                episode.done, episode.truncated = bool(result.done), bool(result.truncated)
                episode.stop = "truncated" if result.truncated and not result.done else "done"
                break
        episode.metrics["tool_calls"] += time.monotonic() - started
        return tool_messages

    async def append(self, tool_messages: list[dict[str, Any]]) -> None:
        """The turn's tool messages, appended unless they would pass the response length (then the
        episode stops there)."""
        episode = self.episode
        previous = list(episode.messages)
        longer = await self.render.messages(self.stream, previous, previous + tool_messages, self.tools)
        if len(longer.mask) >= self.response_length:
            episode.stop = "response_length"
            return
        self.stream = longer
        episode.messages += tool_messages
        episode.user_turns += 1

    def finish(self) -> None:
        """The trajectory: the stream's prompt and response, cut to the response length."""
        episode, stream, length = self.episode, self.stream, self.response_length
        episode.prompt_ids = stream.prompt_ids
        episode.response_ids = stream.response_ids[:length]
        episode.response_mask = stream.mask[:length]
        episode.response_logprobs = stream.logprobs[:length] if stream.logprobs else None

    async def close(self, outage_wait_s: float) -> None:
        """Close the session, if one was opened. An episode a fault ended has waited out the outage
        once already: one try then."""
        session_id = self.episode.session_id
        if not session_id:
            return
        wait_s = 0.0 if self.episode.infrastructure_failure else outage_wait_s
        try:
            await self.outage.call_async(
                lambda: self.client.close_session(session_id), f"CodeGym CloseSession {session_id}", wait_s
            )
        except (grpc.RpcError, ValueError, RuntimeError) as exc:  # idle expiry reclaims it
            log.warning("could not close CodeGym session %s: %s", session_id, exc)


def _decode(tokenizer: Tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def _read_turn(tokenizer: Tokenizer, turn: list[int]) -> tuple[str, list[int]]:
    """A model turn's text for the conversation, and its tokens outside `<think>` (what the tool
    parser reads): decodes, run off the event loop."""
    raw = tokenizer.decode(turn, skip_special_tokens=False)
    shown = visible_text(raw)
    visible = turn if shown == raw else as_ids(tokenizer.encode(shown, add_special_tokens=False))
    return _decode(tokenizer, turn), visible


def _assistant_message(text: str, calls: list[ToolCall]) -> dict[str, Any]:
    """The model's turn as a chat message, its calls as OpenAI tool calls (as verl's ToolAgentLoop
    appends it), so that a chat template or verl's builder sees a well-formed conversation."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = [
            {"type": "function", "function": {"name": name, "arguments": _arguments(arguments)}}
            for name, arguments in calls
        ]
    return message


def _arguments(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _failed(episode: Episode, call: str, exc: BaseException) -> Episode:
    reason = exc.reason if isinstance(exc, CodeGymError) else type(exc).__name__
    episode.infrastructure_failure = True
    episode.failure_reason = f"{call}: {reason or 'UNKNOWN'}: {exc}"[:500]
    episode.stop = "infrastructure"
    log.warning("CodeGym episode ended by an infrastructure fault: %s", episode.failure_reason)
    return episode
