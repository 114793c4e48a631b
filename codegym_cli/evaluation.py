"""Agent evaluation: any OpenAI-compatible model played through the runtime, as a trainer would.

For every task (a training instance, or a task config of the library) and each of K samples:
open a session, give the model CodeGym's prompt (system = tool list, user = protocol + task),
and loop: the model answers, one action goes to the runtime, the observation goes back as the
next message, until the episode is done, truncated, or `max_turns` replies were made. In text
mode the action is the call between `<|FunctionCallBegin|>` markers (a reply without a valid
call is sent as is, and the runtime's error text is what the model sees next, as in training);
in json mode the model gets OpenAI tool schemas and its first `tool_calls` entry is the action.

Every finished episode is one line of `OUT/episodes.jsonl`, written as it ends, so an
interrupted run continues without redoing finished episodes. The summary (success rate, pass@1,
pass@k with the unbiased estimator, turns, tokens, end reasons; per environment and overall, and
per task config for difficulty filtering) is computed from that file.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clients.actions import ActionParseError, from_tool_calls, parse_function_call
from clients.runtime_client import AsyncRuntimeClient
from codegym.contract import parse_ability
from codegym.runtime.v1 import runtime_service_pb2 as rt
from codegym_cli.export import build_instances
from services.runtime.library import Library
from services.synthesis.llm import LLMGateway, LLMRejected, LLMUnavailable, StageParams, StageUsage

END_REASONS = ("solved", "wrong_answer", "truncated", "format_errors", "llm_error", "runtime_error")
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


def tasks_from_library(path: str | Path, tool_mode: str, prefix: str = "") -> list[EvalTask]:
    """Every task config of the library, with the prompt `codegym export` would write."""
    with Library(path) as library:
        records = [r for r in library.load_all().values() if r.env_id.startswith(prefix)]
    built = build_instances(
        records,
        tools="json" if tool_mode == "json" else "text",
        min_rounds=0,
        max_rounds=10**9,
        include_unverified=True,
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


def pass_at_k(samples: int, solved: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    if samples - solved < k:
        return 1.0
    return 1.0 - math.comb(samples - solved, k) / math.comb(samples, k)


def score_name(model: str, samples: int) -> str:
    """CodeGym's name for a per-config success rate, e.g. `qwen32b_Bo4_score`."""
    return f"{re.sub(r'[^A-Za-z0-9.-]+', '-', model).strip('-') or 'model'}_Bo{samples}_score"


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
        started = time.monotonic()
        usage = StageUsage()
        messages: list[dict[str, Any]] = [dict(m) for m in task.prompt]
        if self.tool_mode == "json":
            messages = [m for m in messages if m.get("role") != "system"]
        actions: list[str] = []
        observations: list[str] = []
        format_errors = 0
        reward, done, truncated, reason = 0.0, False, False, ""
        limit = min(task.max_rounds, self.max_turns) if self.max_turns else task.max_rounds
        try:
            tools = await self.schemas(task) if self.tool_mode == "json" else None
            session = await self.runtime.create_session(ability=task.ability)
        except Exception as exc:  # the runtime refused the task: record it, go on with the others
            return self.record(
                task, sample, messages, actions, observations, "runtime_error", str(exc), usage, started
            )
        try:
            for _ in range(limit):
                try:
                    reply = await self.gateway.chat(STAGE, messages, self.params, tools=tools, usage=usage)
                except (LLMUnavailable, LLMRejected) as exc:
                    reason = "llm_error"
                    observations.append(f"LLM error: {exc}")
                    break
                action, message, call_id = self.action_of(reply.text, list(reply.tool_calls))
                messages.append(message)
                step = await self.runtime.step(session.session_id, action)
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
            reason = "runtime_error"
            observations.append(f"runtime error: {exc}")
        finally:
            with contextlib.suppress(Exception):
                await self.runtime.close_session(session.session_id)
        if not reason:
            if done and not truncated:
                reason = "solved" if reward >= 1.0 else "wrong_answer"
            elif actions and format_errors == len(actions):
                reason = "format_errors"
            else:
                reason = "truncated"
        result = self.record(task, sample, messages, actions, observations, reason, "", usage, started)
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


def done_keys(path: Path) -> set[str]:
    """Episodes already finished (a line cut by an interruption is not one)."""
    keys = set()
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                keys.add(json.loads(line)["key"])
            except (ValueError, KeyError, TypeError):
                continue
    return keys


async def run_episodes(
    evaluator: Evaluator,
    tasks: list[EvalTask],
    samples: int,
    out: Path,
    concurrency: int,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> int:
    """Play every (task, sample) not yet in OUT/episodes.jsonl; returns how many were played now."""
    path = out / "episodes.jsonl"
    finished = done_keys(path)
    todo = [(t, s) for t in tasks for s in range(samples) if f"{t.ability}#{s}" not in finished]
    limit = asyncio.Semaphore(concurrency)
    with open(path, "a", encoding="utf-8") as sink:

        async def one(task: EvalTask, sample: int) -> None:
            async with limit:
                result = await evaluator.episode(task, sample)
            sink.write(json.dumps(result, ensure_ascii=False) + "\n")
            sink.flush()
            if progress is not None:
                progress(result)

        await asyncio.gather(*(one(t, s) for t, s in todo))
    return len(todo)


def summarize(path: Path, samples: int, model: str) -> dict[str, Any]:
    """Figures per environment and overall, and the success rate of every task config."""
    episodes: dict[str, dict[str, Any]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            item = json.loads(line)
            episodes[item["key"]] = item
        except (ValueError, KeyError, TypeError):
            continue
    by_task: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for item in episodes.values():
        by_task[item["ability"]].append(item)

    def figures(tasks: list[str]) -> dict[str, Any]:
        items = [e for t in tasks for e in by_task[t]]
        if not items:
            return {}
        solved = [sum(e["end_reason"] == "solved" for e in by_task[t]) for t in tasks]
        counts = [len(by_task[t]) for t in tasks]
        return {
            "tasks": len(tasks),
            "episodes": len(items),
            "success_rate": round(sum(solved) / len(items), 4),
            "pass@1": round(
                sum(pass_at_k(n, c, 1) for n, c in zip(counts, solved, strict=True)) / len(tasks), 4
            ),
            f"pass@{samples}": round(
                sum(pass_at_k(n, c, min(samples, n)) for n, c in zip(counts, solved, strict=True))
                / len(tasks),
                4,
            ),
            "mean_turns": round(sum(e["turns"] for e in items) / len(items), 2),
            "prompt_tokens": sum(e["prompt_tokens"] for e in items),
            "completion_tokens": sum(e["completion_tokens"] for e in items),
            "end_reasons": dict(Counter(e["end_reason"] for e in items)),
        }

    envs: dict[str, list[str]] = defaultdict(list)
    for ability, items in by_task.items():
        envs[items[0]["env_id"]].append(ability)
    name = score_name(model, samples)
    return {
        "model": model,
        "samples": samples,
        "score_name": name,
        "overall": figures(list(by_task)),
        "environments": {env: figures(abilities) for env, abilities in sorted(envs.items())},
        "configs": {
            ability: {
                "env_id": items[0]["env_id"],
                "samples": len(items),
                "solved": sum(e["end_reason"] == "solved" for e in items),
                "success_rate": round(sum(e["end_reason"] == "solved" for e in items) / len(items), 4),
            }
            for ability, items in sorted(by_task.items())
        },
    }
