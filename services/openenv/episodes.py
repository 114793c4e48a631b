"""A socket's episode: reset opens a runtime session from OpenEnv's reset data (CodeGym's
`ability`, or `env` + `config`), steps translate OpenEnv's tool-call actions (and our native
`{"name", "parameters"}`) to runtime steps, and `state` reports the episode.

`Episodes` is everything of the gateway that talks to the runtime: it owns the runtime client and
the set of connections holding a session; the gateway (gateway.py) owns the sockets, the MCP
tokens and the locks, and calls in with the connection whose lock it holds. Every method that
changes `conn.episode` expects its caller to hold `conn.lock`.

The session count is never kept by hand: it is `len(held)`, the connections that hold a runtime
session or are creating one (a slot is taken before the create, so concurrent resets cannot pass
`--max-sessions` together). A session being closed is no longer held: its connection leaves the
set before the runtime is asked to close it. Adding and discarding are idempotent, so no path can
count a session twice or drive the count below zero; every change to a connection's episode happens
under its lock. Without `--max-sessions` the runtime's own session cap is the limit (protocol.py,
`GatewayConfig.max_sessions`).
"""

from __future__ import annotations

import asyncio
import logging
import random
import uuid
from dataclasses import dataclass
from typing import Any

from codegym_client.abilities import ABILITY_FORMAT
from codegym_client.api.runtime.v1 import runtime_service_pb2 as rt
from codegym_client.async_client import AsyncRuntimeClient
from codegym_client.errors import CodeGymError, SessionNotFound
from services.fronting import ForwardTenant, playing_for
from services.openenv import metrics
from services.openenv.protocol import (
    CAPACITY_REACHED,
    SESSION_ERROR,
    STEP_ERROR_NAMES,
    TOOL_ERRORS,
    VALIDATION_ERROR,
    Connection,
    FixedEnv,
    GatewayConfig,
    GatewayError,
    HeldSession,
    from_runtime,
    optional_int,
    tool_entry,
)

log = logging.getLogger("codegym.openenv")


@dataclass(frozen=True)
class ResetRequest:
    """A reset's data, checked: the task (an ability, or an environment and its config), the
    episode's id if the client names it, and the create's named arguments (seed, max_steps, run)."""

    ability: str
    env_id: str
    config: dict[str, Any] | str | None
    episode_id: str | None
    named: dict[str, Any]


class Episodes:
    """The runtime sessions of a gateway's connections (one at a time per connection)."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.client: AsyncRuntimeClient | None = None  # made by start(), in the event loop
        self.held: set[Connection] = set()  # connections holding (or creating) a runtime session
        self.draining = False  # SIGTERM (Gateway.drain): no new episode
        self.fixed: FixedEnv | None = None  # the --env environment, read from the runtime on first use

    def start(self) -> None:
        """Open the runtime client: an asyncio gRPC channel is made inside the running loop."""
        self.client = AsyncRuntimeClient(
            self.config.runtime,
            timeout_s=self.config.runtime_timeout_s,
            access=self.config.access,
            interceptors=[ForwardTenant()],
        )

    async def stop(self) -> None:
        """Close the runtime client (after the gateway has closed its connections' episodes)."""
        if self.client is not None:
            await self.client.close()

    @property
    def runtime(self) -> AsyncRuntimeClient:
        assert self.client is not None, "the gateway has not started"
        return self.client

    @property
    def sessions(self) -> int:
        """Runtime sessions held (or being created) by the gateway's connections."""
        return len(self.held)

    async def close(self, conn: Connection) -> None:
        """Close the episode the connection holds (never raises); the caller holds `conn.lock`.

        The connection stops counting before the runtime is asked: a close in flight holds nothing a
        new episode could use, so a client that closes its socket and opens the next episode's at
        once is never refused for the session it is giving back (issue #31: 1,024 such clients drew
        95 CAPACITY_REACHED a minute while closes were counted until the runtime answered)."""
        episode, conn.episode = conn.episode, None
        self.held.discard(conn)
        if episode is None:
            return
        try:
            with playing_for(conn.tenant):  # the session is the caller's tenant's at the runtime
                await asyncio.wait_for(self.runtime.close_session(episode.session_id), 30)
        except (CodeGymError, TimeoutError) as exc:
            log.warning("closing session %s: %s", episode.session_id, exc)

    async def fixed_env(self) -> FixedEnv | None:
        """The gateway's one environment (`--env`), or None when resets name their own."""
        if not self.config.env:
            return None
        if self.fixed is None:
            try:
                env = await self.runtime.get_env(self.config.env)
            except CodeGymError as exc:
                raise from_runtime(exc) from None
            self.fixed = FixedEnv([tool_entry(t) for t in env.tools], [t.config_json for t in env.tasks])
        return self.fixed

    async def listed_tools(self, conn: Connection) -> list[dict[str, Any]]:
        """The tools a client sees: its episode's, else (before any reset) the --env environment's."""
        if conn.episode is not None:
            return conn.episode.tools
        fixed = await self.fixed_env()
        return fixed.tools if fixed is not None else []

    async def reset(self, conn: Connection, data: dict[str, Any]) -> dict[str, Any]:
        """OpenEnv's reset: end the connection's episode, open a new one (caller holds `conn.lock`)."""
        asked = await self.reset_request(data)
        # A second reset on one socket ends the first episode (TRL reuses clients).
        await self.close(conn)
        self.take_slot(conn)
        try:
            with playing_for(conn.tenant):  # the session is opened as the caller's tenant's
                if asked.ability:
                    created = await self.runtime.create_session(ability=asked.ability, **asked.named)
                else:
                    created = await self.runtime.create_session(
                        env_id=asked.env_id, config=asked.config, **asked.named
                    )
        except CodeGymError as exc:
            self.held.discard(conn)
            raise from_runtime(exc) from None
        except BaseException:
            self.held.discard(conn)
            raise
        episode = HeldSession(
            session_id=created.session_id,
            episode_id=asked.episode_id or uuid.uuid4().hex,
            env_id=created.env_id,
            max_steps=created.max_steps,
            tools=[tool_entry(t) for t in created.tools],
        )
        if conn.closed:  # the socket went away while the runtime created the session
            conn.episode = episode
            await self.close(conn)
            raise GatewayError(SESSION_ERROR, "the socket closed")
        conn.episode = episode
        return reset_reply(episode, created)

    async def reset_request(self, data: dict[str, Any]) -> ResetRequest:
        """What a reset asks for, checked; a reset naming no environment plays the --env one (a
        task by its seed, else at random)."""
        ability = data.get("ability") or ""
        env_id = data.get("env") or data.get("env_id") or ""
        config = data.get("config")
        if not isinstance(ability, str) or not isinstance(env_id, str):
            raise GatewayError(VALIDATION_ERROR, "ability and env are strings")
        if not ability and not env_id and self.config.env:
            env_id = self.config.env
            if config is None:
                seed = optional_int(data, "seed") if data.get("seed") is not None else None
                config = await self.task_config(seed)
        if not ability and not env_id:
            raise GatewayError(
                VALIDATION_ERROR,
                f"reset needs an environment: ability ('{ABILITY_FORMAT}', a training instance's "
                "column) or env ('{code_id}__{Env}') with config",
            )
        if config is not None and not isinstance(config, dict | str):
            raise GatewayError(VALIDATION_ERROR, "config is an object or its JSON text")
        seed = optional_int(data, "seed")
        max_steps = optional_int(data, "max_steps")
        episode_id = data.get("episode_id")
        if episode_id is not None and (not isinstance(episode_id, str) or len(episode_id) > 255):
            raise GatewayError(VALIDATION_ERROR, "episode_id is a string of at most 255 characters")
        # The trainer's run and policy version, for the runtime's record of the episode's outcome
        # (what `Stats` and `SampleTasks` read for that run).
        run_id = data.get("run_id") or ""
        if not isinstance(run_id, str) or len(run_id) > 255:
            raise GatewayError(VALIDATION_ERROR, "run_id is a string of at most 255 characters")
        policy_version = (
            optional_int(data, "policy_version") if data.get("policy_version") is not None else None
        )
        named = {"seed": seed, "max_steps": max_steps, "run_id": run_id, "policy_version": policy_version}
        return ResetRequest(ability, env_id, config, episode_id, named)

    def take_slot(self, conn: Connection) -> None:
        """Count `conn` as holding a session before its create, so that concurrent resets count it;
        refused while draining or at --max-sessions."""
        if self.draining:
            raise GatewayError(
                CAPACITY_REACHED,
                "DRAINING: the gateway is shutting down and starts no new episode; reconnect (the "
                "Service routes to another replica) and reset there",
                reason="DRAINING",
                retryable=True,
            )
        if 0 < self.config.max_sessions <= len(self.held):
            raise GatewayError(
                CAPACITY_REACHED,
                f"the gateway holds {len(self.held)} sessions, its limit (--max-sessions): retry later",
                active_sessions=len(self.held),
                max_sessions=self.config.max_sessions,
            )
        self.held.add(conn)

    async def task_config(self, seed: int | None) -> str:
        """The --env environment's task config for a reset that names none: by `seed` (the same
        seed, the same task, as OpenEnv servers read a seed), else one at random."""
        fixed = await self.fixed_env()
        if fixed is None or not fixed.configs:
            raise GatewayError(
                VALIDATION_ERROR,
                f"the library has no task config of {self.config.env}: give reset a config",
            )
        index = seed % len(fixed.configs) if seed is not None else random.randrange(len(fixed.configs))
        return fixed.configs[index]

    async def act(self, conn: Connection, action: dict[str, Any]) -> dict[str, Any]:
        """OpenEnv's step: list_tools, call_tool, or CodeGym's own action (caller holds `conn.lock`)."""
        kind = action.get("type")
        if kind == "list_tools":
            tools = await self.listed_tools(conn)
            metadata: dict[str, Any] = {}
            if conn.episode is None and not self.config.env:
                metadata["hint"] = "the tools depend on the environment: reset first"
            return {
                "observation": {"tools": tools, "metadata": metadata},
                "reward": None,
                "done": False,
                "metadata": metadata,
            }
        if kind == "call_tool":
            name, arguments = action.get("tool_name"), action.get("arguments", {})
            if not isinstance(name, str) or not name:
                raise GatewayError(VALIDATION_ERROR, "call_tool needs tool_name (a string)")
            if not isinstance(arguments, dict):
                raise GatewayError(VALIDATION_ERROR, "call_tool arguments must be an object")
            return await self.step(conn, {"name": name, "parameters": arguments}, name)
        if kind is not None:
            raise GatewayError(
                VALIDATION_ERROR,
                f"unknown action type {kind!r}: call_tool, list_tools, or a CodeGym action "
                '{"name": TOOL, "parameters": {...}}',
            )
        name = action.get("name")
        if not isinstance(name, str):
            raise GatewayError(
                VALIDATION_ERROR,
                'an action is {"type": "call_tool", "tool_name": ..., "arguments": {...}}, '
                '{"type": "list_tools"} or CodeGym\'s {"name": ..., "parameters": {...}}',
            )
        return await self.step(conn, action, name)

    async def step(self, conn: Connection, action: dict[str, Any], name: str) -> dict[str, Any]:
        """One runtime step of the connection's episode (caller holds `conn.lock`); an expired
        session is forgotten, so the connection no longer counts as holding one."""
        episode = conn.episode
        if episode is None:
            raise GatewayError(SESSION_ERROR, "no episode on this socket: send reset first")
        try:
            with playing_for(conn.tenant):
                response = await self.runtime.step(episode.session_id, action)
        except CodeGymError as exc:
            metrics.STEPS.labels(exc.reason).inc()
            if isinstance(exc, SessionNotFound) and conn.episode is episode:  # expired: forget it
                conn.episode = None
                self.held.discard(conn)
            raise from_runtime(exc) from None
        code = response.error.code if response.HasField("error") else 0
        metrics.STEPS.labels(STEP_ERROR_NAMES.get(code, "ok")).inc()
        episode.step_count = response.step_index
        episode.done = response.done
        episode.truncated = response.truncated
        episode.reward = response.reward
        tool_error = None
        if code in TOOL_ERRORS:
            tool_error = {"error_type": TOOL_ERRORS[code], "message": response.error.message}
        metadata: dict[str, Any] = {"truncated": response.truncated, "step_count": response.step_index}
        if code:
            metadata["step_error"] = STEP_ERROR_NAMES.get(code, str(code))
        observation = {
            "tool_name": name,
            "result": response.observation,
            "error": tool_error,
            "metadata": metadata,
        }
        reward = float(response.reward) if response.done else None
        return {"observation": observation, "reward": reward, "done": response.done, "metadata": metadata}

    def state(self, conn: Connection) -> dict[str, Any]:
        episode = conn.episode
        if episode is None:
            return {"episode_id": None, "step_count": 0}
        return {
            "episode_id": episode.episode_id,
            "step_count": episode.step_count,
            "env_id": episode.env_id,
            "max_steps": episode.max_steps,
            "done": episode.done,
            "truncated": episode.truncated,
            "reward": episode.reward,
        }


def reset_reply(episode: HeldSession, created: rt.CreateSessionResponse) -> dict[str, Any]:
    """OpenEnv's answer to a reset: the task, first observation and tools, with the episode's
    metadata."""
    metadata = {
        "env_id": episode.env_id,
        "episode_id": episode.episode_id,
        "session_id": episode.session_id,
        "max_steps": episode.max_steps,
        "task": created.task_text,
        "truncated": False,
    }
    observation = {
        "task": created.task_text,
        "observation": created.observation,
        "tools_text": created.tools_text,
        "tools": episode.tools,
        "metadata": metadata,
    }
    return {"observation": observation, "reward": None, "done": False, "metadata": metadata}
