"""Agent evaluation: any OpenAI-compatible model played through the runtime, as a trainer would.

For every task (a training instance, or a task config of the library) and each of K samples:
open a session, give the model CodeGym's prompt (system = tool list, user = protocol + task),
and loop: the model answers, one action goes to the runtime, the observation goes back as the
next message, until the episode is done, truncated, or `max_turns` replies were made. In text
mode the action is the call between `<|FunctionCallBegin|>` markers (a reply without a valid
call is sent as is, and the runtime's error text is what the model sees next, as in training);
in json mode the model gets OpenAI tool schemas and its first `tool_calls` entry is the action.

Only the agent's own outcomes are episodes: the reward reached, a wrong answer, the turn limit,
replies without a valid tool call answered by the environment, the conversation outgrowing the
model's context window after the first turn (the endpoint's 400 says so; the same request would
fail again). At the first turn the same refusal means the task and `--max-tokens` do not fit the
model: a setting, so that attempt is a failure (`llm_error`), played again by the next run. An attempt that ended because
something else failed (the runtime unreachable, a session lost, an internal error, the LLM
endpoint failing past its retries) says nothing about the model: counting it as unsolved would
make the figures measure the infrastructure, and a config's stored score would mark it "hard"
for ever. Such an attempt is written to `OUT/failures.jsonl` with its error text and is played
again by the next run of the same command; it never enters a figure or a score.

Every counted episode is one line of `OUT/episodes.jsonl`, written as it ends, so an interrupted
run continues without redoing finished episodes. The summary (success rate, pass@1, pass@k with
the unbiased estimator, turns, tokens, end reasons; per environment and overall, and per task
config for difficulty filtering) is computed from the counted episodes, and says how many were
not counted and why.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from codegym.contract import parse_ability
from codegym.library.store import Library
from codegym_client.actions import ActionParseError, from_tool_calls, parse_function_call
from codegym_client.api.runtime.v1 import runtime_service_pb2 as rt
from codegym_client.async_client import AsyncRuntimeClient
from codegym_jobs.appending import open_to_append
from codegym_jobs.evaluation.results import (
    COUNTED_REASONS,
    done_keys,
    failures_path,
)
from codegym_jobs.export.instances import build_instances
from services.synthesis.llm import (
    ContextLengthExceeded,
    LLMGateway,
    LLMRejected,
    LLMUnavailable,
    StageParams,
    StageUsage,
)

MAX_ERROR_CHARS = 2000
FORMAT_ERRORS = (rt.STEP_ERROR_CODE_INVALID_ACTION, rt.STEP_ERROR_CODE_UNKNOWN_TOOL)
STAGE = "agent"


@dataclass
class EvalTask:
    """One task an agent plays: the ability opens the session, the prompt starts the conversation."""

    ability: str
    env_id: str
    prompt: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)
    max_rounds: int = 256


def tasks_from_instances(path: str | Path) -> list[EvalTask]:
    tasks = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            ability = parse_ability(str(item["ability"]))
            prompt = list(item["prompt"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{number}: not a training instance: {exc}") from None
        tasks.append(
            EvalTask(
                str(item["ability"]),
                ability.env_id,
                prompt,
                list(item.get("tools") or []),
                int(item.get("plugin_call_max_round") or 256),
            )
        )
    return tasks


def tasks_from_library(
    path: str | Path, tool_mode: str, prefix: str = "", learnability: Container[str] | None = None
) -> list[EvalTask]:
    """Every task config of the library (given `learnability`, those labelled so), with the prompt
    `codegym export` would write."""
    with Library(path) as library:
        records = [r for r in library.load_all().values() if r.env_id.startswith(prefix)]
    built = build_instances(
        records,
        tools="json" if tool_mode == "json" else "text",
        min_rounds=0,
        max_rounds=10**9,
        include_unverified=True,
        learnability=learnability,
    )
    return [
        EvalTask(
            i["ability"],
            i["extra_info"]["env_id"],
            i["prompt"],
            i.get("tools", []),
            i["plugin_call_max_round"],
        )
        for i in built.train
    ]


def error_text(exc: BaseException) -> str:
    """What went wrong, never empty: the exception's type and message (and its cause when the
    message says nothing), so a failed attempt can be diagnosed from `failures.jsonl` alone."""
    message = str(exc).strip()
    text = f"{type(exc).__name__}: {message}" if message else f"{type(exc).__name__} (no message): {exc!r}"
    cause = exc.__cause__ or exc.__context__
    if cause is not None and not message:
        text += f" (caused by {type(cause).__name__}: {str(cause).strip() or repr(cause)})"
    return text[:MAX_ERROR_CHARS]


def failure_of(exc: BaseException) -> str:
    """The failure reason of an exception that ended an attempt (see FAILURE_REASONS)."""
    if isinstance(exc, LLMUnavailable | LLMRejected):
        return "llm_error"
    if isinstance(exc, grpc.RpcError):  # every CodeGymError of the runtime client is one
        return "runtime_error"
    return "internal_error"


class Evaluator:
    """Plays episodes; create inside the running loop."""

    def __init__(
        self,
        runtime: AsyncRuntimeClient,
        gateway: LLMGateway,
        params: StageParams,
        *,
        tool_mode: str = "text",
        max_turns: int = 0,
    ) -> None:
        self.runtime = runtime
        self.gateway = gateway
        self.params = params
        self.tool_mode = tool_mode
        self.max_turns = max_turns
        self.tool_schemas: dict[str, list[dict[str, Any]]] = {}

    async def schemas(self, task: EvalTask) -> list[dict[str, Any]]:
        """The env's OpenAI tool schemas (from the instance, else from the runtime's GetEnv)."""
        if task.tools:
            return task.tools
        if task.env_id not in self.tool_schemas:
            env = await self.runtime.get_env(task.env_id)
            self.tool_schemas[task.env_id] = [json.loads(t.json_schema) for t in env.tools]
        return self.tool_schemas[task.env_id]

    async def episode(self, task: EvalTask, sample: int) -> dict[str, Any]:
        """One attempt at (task, sample): an episode (`counted`) or a failure with its error text.

        Any exception ends the attempt as a failure, whatever call raised it: the model's
        replies and the environment's answers (step errors included) arrive as values, so an
        exception is always something outside the agent's control, and the partial
        conversation is kept only to diagnose it. One exception is the model's own limit: the
        endpoint refusing the conversation, after the first turn, as longer than the model's
        context ends the episode, counted as `context_length` with the endpoint's words in `error`.
        """
        started = time.monotonic()
        usage = StageUsage()
        messages: list[dict[str, Any]] = [dict(m) for m in task.prompt]
        if self.tool_mode == "json":
            messages = [m for m in messages if m.get("role") != "system"]
        actions: list[str] = []
        observations: list[str] = []
        format_errors = 0
        overflow = ""
        reward, done, truncated = 0.0, False, False
        limit = min(task.max_rounds, self.max_turns) if self.max_turns else task.max_rounds
        session_id = ""
        try:
            tools = await self.schemas(task) if self.tool_mode == "json" else None
            session = await self.runtime.create_session(ability=task.ability)
            session_id = session.session_id
            for _ in range(limit):
                try:
                    reply = await self.gateway.chat(STAGE, messages, self.params, tools=tools, usage=usage)
                except ContextLengthExceeded as exc:
                    if not actions:  # the task alone leaves no room: a setting (--max-tokens), not play
                        raise
                    overflow = error_text(exc)  # the conversation outgrew the model: ends unsolved
                    break
                action, message, call_id = self.action_of(reply.text, list(reply.tool_calls))
                messages.append(message)
                step = await self.runtime.step(session_id, action)
                actions.append(action)
                observations.append(step.observation)
                if step.error.code in FORMAT_ERRORS:
                    format_errors += 1
                if call_id:
                    messages.append({"role": "tool", "tool_call_id": call_id, "content": step.observation})
                else:
                    messages.append({"role": "user", "content": step.observation})
                reward, done, truncated = step.reward, step.done, step.truncated
                if done:
                    break
        except Exception as exc:
            return self.record(
                task,
                sample,
                messages,
                actions,
                observations,
                failure_of(exc),
                error_text(exc),
                usage,
                started,
            )
        finally:
            if session_id:
                with contextlib.suppress(Exception):
                    await self.runtime.close_session(session_id)
        if overflow:
            reason = "context_length"
        elif done and not truncated:
            reason = "solved" if reward >= 1.0 else "wrong_answer"
        elif actions and format_errors == len(actions):
            reason = "format_errors"
        else:
            reason = "truncated"
        result = self.record(task, sample, messages, actions, observations, reason, overflow, usage, started)
        result.update(reward=reward, format_errors=format_errors)
        return result

    def action_of(self, text: str, tool_calls: list[dict[str, Any]]) -> tuple[str, dict[str, Any], str]:
        """(action sent to the runtime, the assistant message to keep, the tool call id answered)."""
        if self.tool_mode == "json" and tool_calls:
            first = tool_calls[0]  # one action per turn, as CodeGym trains
            message = {"role": "assistant", "content": text or None, "tool_calls": [first]}
            try:
                return from_tool_calls([first])[0].to_json(), message, str(first.get("id", ""))
            except ActionParseError:
                return json.dumps(first.get("function", {})), message, str(first.get("id", ""))
        message = {"role": "assistant", "content": text}
        try:
            return parse_function_call(text).to_json(), message, ""
        except ActionParseError:
            return text, message, ""  # the runtime's error text becomes the next message

    @staticmethod
    def record(
        task: EvalTask,
        sample: int,
        messages: list[dict[str, Any]],
        actions: list[str],
        observations: list[str],
        reason: str,
        error: str,
        usage: StageUsage,
        started: float,
    ) -> dict[str, Any]:
        return {
            "key": f"{task.ability}#{sample}",
            "ability": task.ability,
            "env_id": task.env_id,
            "sample": sample,
            "end_reason": reason,
            "counted": reason in COUNTED_REASONS,
            "error": error,
            "reward": 0.0,
            "turns": len(actions),
            "actions": actions,
            "observations": observations,
            "messages": messages,
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "llm_requests": usage.requests,
            "wall_s": round(time.monotonic() - started, 3),
        }


@dataclass
class RunCounts:
    """What one run did. `failed` attempts are in failures.jsonl; `skipped` ones never started
    because the run gave up after consecutive failures (an outage: every further attempt would
    fail the same way, each after its own retries)."""

    played: int = 0
    counted: int = 0
    failed: int = 0
    skipped: int = 0


async def run_episodes(
    evaluator: Evaluator,
    tasks: list[EvalTask],
    samples: int,
    out: Path,
    concurrency: int,
    progress: Callable[[dict[str, Any]], None] | None = None,
    *,
    give_up_after: int = 0,
) -> RunCounts:
    """Play every (task, sample) not yet counted in OUT/episodes.jsonl.

    Counted episodes go to OUT/episodes.jsonl, failed attempts to OUT/failures.jsonl. With
    `give_up_after` > 0, no new attempt starts once that many attempts in a row have failed
    (those left are `skipped`, and played by the next run like the failed ones).
    """
    path = out / "episodes.jsonl"
    limit = asyncio.Semaphore(concurrency)
    counts = RunCounts()
    in_a_row = 0
    # Opened (a line torn by a killed run cut off) before the finished episodes are read: a torn
    # line is no episode, and is played again.
    with open_to_append(path) as sink, open_to_append(failures_path(path)) as failed:
        finished = done_keys(path)
        todo = [(t, s) for t in tasks for s in range(samples) if f"{t.ability}#{s}" not in finished]

        async def one(task: EvalTask, sample: int) -> None:
            nonlocal in_a_row
            async with limit:
                if give_up_after and in_a_row >= give_up_after:
                    counts.skipped += 1
                    return
                result = await evaluator.episode(task, sample)
            counts.played += 1
            if result["counted"]:
                counts.counted += 1
                in_a_row = 0
                target = sink
            else:
                counts.failed += 1
                in_a_row += 1
                target = failed
            target.write(json.dumps(result, ensure_ascii=False) + "\n")
            target.flush()
            if progress is not None:
                progress(result)

        await asyncio.gather(*(one(t, s) for t, s in todo))
    return counts
