"""A scripted agent that plays a sample environment with that environment's own `solve()`.

`codegym eval` needs a model that plays as an agent; without one, the scripted server
(codegym_testkit/fake_llm.py) answers an agent's chat completion with the next tool call the
environment's oracle would make. The oracle is the env's `solve()` (every sample env's
`solve()` talks to the env through `self.step` only), so the conversation itself is enough to
know its next call: `solve()` is run again from the start on a bare instance (no config, no
hidden state) whose `step` answers the observations of the conversation in order; the first
call past them is the answer. Unlike replaying recorded trajectories, this plays any config,
including the ones a pipeline run generated.

Env code runs only in a child interpreter (as everywhere in the tests): one per process,
started on first use, fed one JSON job per line, stopped by `stop()` (the scripted server
stops it when it closes) or when this process exits (its stdin closes).
"""

from __future__ import annotations

import atexit
import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

PROTOCOL_MARK = "Please answer the following question step by step"
QUESTION_MARK = "Question:"

# Reads {"path", "class", "observations"} lines; answers {"action": str | None, "why": str}.
# `Asked` is a BaseException so that a solve() catching Exception around its calls cannot
# swallow it.
REPLAYER = r"""
import importlib.util, json, sys

class Asked(BaseException):
    pass

modules = {}
for line in sys.stdin:
    job = json.loads(line)
    answer = {"action": None, "why": ""}
    try:
        if job["path"] not in modules:
            spec = importlib.util.spec_from_file_location("env_%d" % len(modules), job["path"])
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            modules[job["path"]] = module
        cls = getattr(modules[job["path"]], job["class"])
        env = cls.__new__(cls)  # no config: the oracle learns everything through its tools
        observations = job["observations"]
        calls = []

        def step(action, observations=observations, calls=calls):
            calls.append(action)
            if len(calls) > len(observations):
                raise Asked()
            return True, observations[len(calls) - 1]

        env.step = step
        try:
            env.solve()
            answer["why"] = "solve() ended"
        except Asked:
            answer["action"] = calls[-1]
    except Exception as exc:  # observations the oracle cannot read (an error text): it is lost
        answer["why"] = "%s: %s" % (type(exc).__name__, exc)
    print(json.dumps(answer), flush=True)
"""

_lock = threading.Lock()
_child: subprocess.Popen[str] | None = None


def is_agent_request(body: dict[str, Any]) -> bool:
    """An agent's turn: CodeGym's protocol and a question in the first user message."""
    text = first_user_text(body.get("messages") or [])
    return PROTOCOL_MARK in text and QUESTION_MARK in text


def first_user_text(messages: list[dict[str, Any]]) -> str:
    return next((str(m.get("content") or "") for m in messages if m.get("role") == "user"), "")


def observations_of(messages: list[dict[str, Any]]) -> list[str]:
    """The observation answered to each action so far: the message after each assistant message."""
    seen: list[str] = []
    for i, message in enumerate(messages):
        if message.get("role") == "assistant" and i + 1 < len(messages):
            seen.append(str(messages[i + 1].get("content") or ""))
    return seen


def next_action(path: Path, env_class: str, observations: list[str]) -> str | None:
    """The oracle's next action (a JSON call) after these observations; None when `solve()`
    ends without another call (the episode should be over) or cannot follow them."""
    global _child
    job = json.dumps({"path": str(path), "class": env_class, "observations": observations})
    with _lock:
        if _child is None or _child.poll() is not None:
            _child = subprocess.Popen(
                [sys.executable, "-c", REPLAYER],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env={"PYTHONHASHSEED": "0", "PATH": "/usr/bin:/bin"},
            )
        assert _child.stdin is not None and _child.stdout is not None
        _child.stdin.write(job + "\n")
        _child.stdin.flush()
        line = _child.stdout.readline()
    if not line:
        raise RuntimeError("the solve() replayer exited")
    action: str | None = json.loads(line)["action"]
    return action


def stop() -> None:
    """End the child interpreter (by its pid); the next `next_action` starts another."""
    global _child
    with _lock:
        child, _child = _child, None
    if child is not None and child.poll() is None:
        assert child.stdin is not None
        child.stdin.close()  # it ends at the end of its input
        try:
            child.wait(5)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(5)


atexit.register(stop)


def tool_call(action: str, number: int) -> dict[str, Any]:
    """An action as one native OpenAI tool call."""
    parsed = json.loads(action)
    return {
        "id": f"call_{number}",
        "type": "function",
        "function": {"name": parsed["name"], "arguments": json.dumps(parsed.get("parameters", {}))},
    }
