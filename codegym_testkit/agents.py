"""Scripted agents behind the OpenAI-compatible test server, for `codegym eval` tests.

Each is a `script(body) -> Reply` for `ScriptedLLM`. The oracle agent replays recorded oracle
trajectories: it finds the environment from the task text in the user message, keeps the
recorded episodes whose actions and observations match the conversation so far, and answers
with the next recorded action (an oracle's next action depends only on what it has seen).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

from codegym_client.actions import ActionParseError, from_tool_calls, parse_function_call
from codegym_testkit.fake_llm import Reply

Script = Callable[[dict[str, Any]], Reply]


def call_text(action: str) -> str:
    return f"Let me call a tool.<|FunctionCallBegin|>[{action}]<|FunctionCallEnd|>"


def tool_call(action: str, n: int) -> dict[str, Any]:
    parsed = json.loads(action)
    return {
        "id": f"call_{n}",
        "type": "function",
        "function": {"name": parsed["name"], "arguments": json.dumps(parsed["parameters"])},
    }


def history(messages: list[dict[str, Any]]) -> list[tuple[Any, str]]:
    """(action as a JSON value, observation) pairs of the conversation after the prompt."""
    pairs: list[tuple[Any, str]] = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        try:
            if message.get("tool_calls"):
                action = from_tool_calls(message["tool_calls"])[0]
            else:
                action = parse_function_call(str(message.get("content") or ""))
            value: Any = {"name": action.name, "parameters": action.parameters}
        except ActionParseError:
            value = None
        following = messages[i + 1] if i + 1 < len(messages) else {}
        pairs.append((value, str(following.get("content", ""))))
    return pairs


def oracle_agent(
    trajectories: list[dict[str, Any]], task_texts: dict[str, str], *, native: bool = False
) -> Script:
    """`task_texts`: env id → task text (how the agent recognises the environment)."""
    by_env: dict[str, list[dict[str, Any]]] = {}
    for t in trajectories:
        by_env.setdefault(t["env_id"], []).append(t)

    def script(body: dict[str, Any]) -> Reply:
        messages = body["messages"]
        user = next(str(m["content"]) for m in messages if m.get("role") == "user")
        env_id = next((e for e, text in task_texts.items() if text and text in user), None)
        if env_id is None:
            return Reply(status=400, error="the oracle agent does not know this task")
        seen = history(messages)
        candidates = [
            t
            for t in by_env.get(env_id, [])
            if len(t["steps"]) > len(seen)
            and all(
                json.loads(t["steps"][k][0]) == action and t["steps"][k][1] == observation
                for k, (action, observation) in enumerate(seen)
            )
        ]
        if not candidates:
            return Reply(["I am lost."])
        action = candidates[0]["steps"][len(seen)][0]
        if native:
            return Reply([""], tool_calls=[[tool_call(action, len(seen))]])
        return Reply([call_text(action)])

    return script


def wrong_agent(body: dict[str, Any]) -> Reply:
    """Answers at once, wrongly."""
    # A string: every sample env compares it without raising, and it is never the answer.
    return Reply([call_text(json.dumps({"name": "Done", "parameters": {"answer": "no idea"}}))])


def malformed_agent(body: dict[str, Any]) -> Reply:
    """Never writes a function call."""
    return Reply(["I think the answer is probably 42, no tools needed."])


def never_done_agent(body: dict[str, Any]) -> Reply:
    """Looks forever."""
    return Reply([call_text(json.dumps({"name": "Observe", "parameters": {}}))])


# vLLM's words for a conversation longer than the model's context window (a 400).
CONTEXT_OVERFLOW = (
    "This model's maximum context length is 4096 tokens. However, you requested 4200 tokens "
    "(3176 in the messages, 1024 in the completion). Please reduce the length of the messages or completion."
)


def short_context_agent(body: dict[str, Any]) -> Reply:
    """Looks, until its conversation outgrows its context: the fourth request is refused (400)."""
    if sum(m.get("role") == "assistant" for m in body["messages"]) >= 3:
        return Reply(status=400, error=CONTEXT_OVERFLOW)
    return never_done_agent(body)


def flaky(script: Script, failures: list[int]) -> Script:
    """The endpoint answers with these HTTP errors first (e.g. [429, 500]), then as `script`."""
    left = list(failures)
    lock = threading.Lock()

    def wrapped(body: dict[str, Any]) -> Reply:
        with lock:
            status = left.pop(0) if left else 0
        if status:
            return Reply(status=status, error=f"scripted {status}", headers={"retry-after-ms": "10"})
        return script(body)

    return wrapped
