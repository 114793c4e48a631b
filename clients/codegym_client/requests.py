"""What a client sends to the runtime service: its name, the default address, and the requests
built from a trainer's arguments (a task to open, an action in any of the forms a trainer holds)."""

from __future__ import annotations

import json
import secrets
from typing import Any

from codegym_client.actions import Action
from codegym_client.api.runtime.v1 import runtime_service_pb2 as rt
from codegym_client.defaults import DEFAULT_TARGET

__all__ = [
    "DEFAULT_TARGET",
    "SERVICE",
    "ActionLike",
    "checkpoint_request",
    "create_request",
    "fork_request",
    "restore_request",
    "sample_request",
    "step_request",
]

SERVICE = rt.DESCRIPTOR.services_by_name["RuntimeService"].full_name
# Calls the channel must never retry by itself: they change sessions, and a blind retry could apply
# a step twice (a StepStream retried before its first answer would send all its steps again).
NOT_RETRIED = [(SERVICE, "Step"), (SERVICE, "BatchStep"), (SERVICE, "StepStream")]

ActionLike = str | dict[str, Any] | Action | rt.ToolCall


def create_request(
    *,
    ability: str = "",
    env_id: str = "",
    config: dict[str, Any] | str | None = None,
    env_str: str = "",
    max_steps: int = 0,
    step_timeout_ms: int = 0,
    seed: int = 0,
    run_id: str = "",
    policy_version: int | None = None,
    keep_history: bool = False,
) -> rt.CreateSessionRequest:
    """`run_id` and `policy_version` (a trainer's run and global step) go into the runtime's record
    of the episode's outcome, which `Stats` and `SampleTasks` read. `keep_history`: the runtime keeps
    the episode's per-step history, so `fork_session(..., at_step=k)` can rewind it."""
    options = rt.SessionOptions(
        max_steps=max_steps, step_timeout_ms=step_timeout_ms, seed=seed, keep_history=keep_history
    )
    if ability:
        request = rt.CreateSessionRequest(ability=ability, options=options, run_id=run_id)
    else:
        config_json = config if isinstance(config, str) else json.dumps(config or {})
        task = rt.EnvTask(env_id=env_id, config_json=config_json if not env_str else "", env_str=env_str)
        request = rt.CreateSessionRequest(env_task=task, options=options, run_id=run_id)
    if policy_version is not None:
        request.policy_version = policy_version
    return request


def sample_request(
    run_id: str,
    n: int,
    *,
    seed: int = 0,
    low: float = 0.0,
    high: float = 1.0,
    explore: float | None = None,
    per_env_cap: int = 0,
    min_episodes: int = 0,
    env_prefix: str = "",
) -> rt.SampleTasksRequest:
    """A SampleTasks request; the defaults are the runtime's (band (0, 1), 5 % exploring)."""
    request = rt.SampleTasksRequest(
        run_id=run_id,
        n=n,
        seed=seed,
        low=low,
        high=high,
        per_env_cap=per_env_cap,
        min_episodes=min_episodes,
        env_prefix=env_prefix,
    )
    if explore is not None:
        request.explore = explore
    return request


def request_id() -> str:
    """A fresh idempotency key: one per call, the same on every resend of it."""
    return secrets.token_hex(16)


def fork_request(
    session_id: str, count: int = 1, at_step: int | None = None, reseed: bool = False, key: str = ""
) -> rt.ForkSessionRequest:
    """`key`: the idempotency key (a fresh one when ""). A caller that sends the same fork again
    itself, past the client's own resends (riding out an outage), gives the same key each time, so
    a fork the runtime committed before its answer was lost is answered, not made twice."""
    request = rt.ForkSessionRequest(
        session_id=session_id, count=count, reseed=reseed, request_id=key or request_id()
    )
    if at_step is not None:
        request.at_step = at_step
    return request


def checkpoint_request(session_id: str, close: bool = False, key: str = "") -> rt.CheckpointSessionRequest:
    """`key`: as `fork_request`'s."""
    return rt.CheckpointSessionRequest(session_id=session_id, close=close, request_id=key or request_id())


def restore_request(blob: bytes, key: str = "") -> rt.RestoreSessionRequest:
    """`key`: as `fork_request`'s."""
    return rt.RestoreSessionRequest(checkpoint=bytes(blob), request_id=key or request_id())


def step_request(session_id: str, action: ActionLike, step_index: int | None = None) -> rt.StepRequest:
    """A StepRequest; with `step_index` (the session's index before this step) it can be resent."""
    if isinstance(action, rt.ToolCall):
        request = rt.StepRequest(session_id=session_id, tool_call=action)
    else:
        if isinstance(action, Action):
            action = action.to_json()
        elif isinstance(action, dict):
            action = json.dumps(action, ensure_ascii=False)
        request = rt.StepRequest(session_id=session_id, action_json=action)
    if step_index is not None:
        request.step_index = step_index
    return request
