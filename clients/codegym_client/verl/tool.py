"""`CodeGymTool`: CodeGym tools as verl `BaseTool`s, for users who stay on `ToolAgentLoop`. Imports verl.

Prefer `CodeGymAgentLoop` (codegym_client/verl/agent_loop.py). This class exists because verl's
`ToolAgentLoop._call_tool` (verl/experimental/agent_loop/tool_agent_loop.py) does, for every single
tool call, `tool.create(create_kwargs=...)`, `tool.execute(instance_id, args, agent_data=...)` and
`tool.release(instance_id)`: a tool instance lives for one call, while a CodeGym environment is one
state for the whole episode. So the session here is keyed by the episode's request id
(`agent_data.request_id`, one per `ToolAgentLoop.run`), not by the tool instance.

Limits (what `ToolAgentLoop` does not tell a tool, and what follows):

- **Session end.** verl never tells a tool that an episode is over. A session is closed when the
  environment ends the episode (done or truncated); an episode cut short by verl (no tool call,
  the turn cap, the response length) leaves its session open until `CodeGymTool.close_idle()`
  (called at every `create`, closing sessions idle for `idle_s`, default 600 s), `close_all()`, or
  the runtime's own idle expiry (`--session-ttl-s`, 30 min by default).
- **Sessions held.** At most `max_sessions` (default 4096) per process, counted from the sessions
  held: opening one more closes the least recently used one (not in a call) in the runtime, with a
  warning. Set it above the episodes a rollout worker plays at once: a later call of an evicted
  episode raises `InfrastructureFailure` (it cannot go on in a new session).
- **Reward.** `ToolAgentLoop` puts each call's tool reward in `extra_fields["tool_rewards"]` and
  never sets `reward_score` nor calls `calc_reward`; the step that ends the episode returns the
  final reward as its tool reward (others 0.0), so the episode's reward is the sum of
  `tool_rewards`: read it in your reward function (verl's reward loop gets `tool_extra_fields`).
- **Infrastructure faults.** An outage is waited out first: creating the session, each step (sent
  with its step index, so a resend the runtime applied already is answered from its record) and
  the close are sent again with back-off for `outage_wait_s` (default 600 s) while the failure
  clears by itself; the process's tools share the wait (`shared_outage`: an outage is counted
  from the first call it failed, then each call is sent once until one is answered).
  `ToolAgentLoop` turns every `Exception` a tool raises into a tool message for the model ("Error
  when executing tool: ..."), and a tool has no way to drop its rollout or mask it (it returns a
  response, a reward and metrics; the loop builds the mask). So a fault that
  outlasts the wait or does not clear (the session lost) raises `InfrastructureFailure`, a
  `BaseException`: it fails the rollout batch instead of putting the outage in the training data.
  A call after the episode ended raises `EpisodeEnded` (an ordinary error, which the model is shown).
- **Tool calls in `<think>`.** The tool parser of `ToolAgentLoop` runs on the whole turn, reasoning
  included; nothing a tool can do about it. `CodeGymAgentLoop` ignores them.
- **Tool sets.** `ToolAgentLoop` shows every row the tools of its tool config file: one
  environment's tools per run (or environments with the same tools); one `CodeGymTool` entry per
  tool, e.g. written by `codegym_client.verl.tool_config(schemas, target)`. verl's schema model keeps only the
  `type`, `description` and `enum` of a parameter (an array's `items` is dropped).
- **Parallel calls.** Keep `multi_turn.max_parallel_calls: 1`: calls of one turn run concurrently,
  in no set order, and an environment's steps are one after the other.

The row gives the ability in its tools kwargs (`extra_info.tools_kwargs`, `{tool name:
{"create_kwargs": {"ability": ...}}}`); one entry under any name is enough, every call of the
episode finds it through `agent_data.tools_kwargs`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from typing import Any, ClassVar
from uuid import uuid4

import grpc

# verl is the trainer's dependency, not the client's (`import codegym_client.verl` does not import
# this module); the client's import fence (tests/test_client_install.py) admits it here.
from verl.tools.base_tool import BaseTool
from verl.tools.schemas import ToolResponse

from codegym_client.errors import STEP_FAULTS, EpisodeEnded, InfrastructureFailure, is_infrastructure
from codegym_client.outages import DEFAULT_OUTAGE_WAIT_S, Outage
from codegym_client.requests import DEFAULT_TARGET
from codegym_client.verl.clients import shared_client, shared_outage

__all__ = ["CodeGymTool"]

log = logging.getLogger(__name__)

ENDED_KEPT = 10_000  # ended and evicted episodes remembered (request id), to answer late calls
DEFAULT_MAX_SESSIONS = 4096  # sessions one process holds at most (config key `max_sessions`)


class _Session:
    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.session_id = ""
        self.used = time.monotonic()
        self.target = ""
        self.step_index = 0  # what the session's next step applies to


class CodeGymTool(BaseTool):
    """One CodeGym tool (its schema from the tool config), stepping the episode's session (see the
    module's docstring for its limits). Config keys: `target` (`HOST:PORT`), `timeout_s`, `idle_s`,
    `max_steps`, `outage_wait_s`, `max_sessions`, `run_id` (the run the runtime records each
    episode's outcome for: a tool gets its tool config alone, not the trainer's, so name it here)."""

    # request id -> the episode's session, least recently used first
    _sessions: ClassVar[OrderedDict[str, _Session]] = OrderedDict()
    _ended: ClassVar[dict[str, float]] = {}  # request id -> final reward
    _evicted: ClassVar[dict[str, str]] = {}  # request id -> the session closed to make room

    def __init__(self, config: dict[str, Any], tool_schema: Any) -> None:
        super().__init__(config, tool_schema)
        self.target = str(config.get("target") or DEFAULT_TARGET)
        self.timeout_s = float(config.get("timeout_s") or 60.0)
        self.idle_s = float(config.get("idle_s") or 600.0)
        self.max_steps = int(config.get("max_steps") or 0)
        wait = config.get("outage_wait_s")
        self.outage_wait_s = float(DEFAULT_OUTAGE_WAIT_S if wait is None else wait)
        self.max_sessions = max(1, int(config.get("max_sessions") or DEFAULT_MAX_SESSIONS))
        self.run_id = str(config.get("run_id") or "")
        self._abilities: dict[str, str] = {}  # instance id -> ability from create_kwargs

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, Any]:
        instance_id = instance_id or uuid4().hex
        ability = (kwargs.get("create_kwargs") or {}).get("ability")
        if isinstance(ability, str):
            self._abilities[instance_id] = ability
        await self.close_idle(self.idle_s)
        return instance_id, ToolResponse()

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[Any, float, dict[str, Any]]:
        agent_data = kwargs.get("agent_data")
        request_id = str(getattr(agent_data, "request_id", "") or instance_id)
        if request_id in self._ended:
            raise EpisodeEnded(f"the episode has ended: {self.name} was not run")
        if request_id in self._evicted:
            raise InfrastructureFailure(
                f"the session of episode {request_id} ({self._evicted[request_id]}) was closed to keep "
                f"CodeGymTool within max_sessions={self.max_sessions}: raise it above the episodes in flight"
            )
        session = self._sessions.get(request_id)
        if session is None:
            session = self._sessions[request_id] = _Session()
            await self._make_room(keep=request_id)
        self._sessions.move_to_end(request_id)
        client = shared_client(self.target, self.timeout_s)
        async with session.lock:
            session.used = time.monotonic()
            if not session.session_id:
                ability = self._abilities.get(instance_id) or _ability(agent_data)
                if not ability:
                    raise ValueError("no 'ability' in the row's tools_kwargs create_kwargs")
                try:
                    created = await self._outage().call_async(
                        # No policy version: verl 0.9.1 hands a tool no step (`create` gets the
                        # row's create_kwargs, `execute` the call's arguments and `agent_data`).
                        lambda: client.create_session(
                            ability=ability, max_steps=self.max_steps, run_id=self.run_id
                        ),
                        f"CodeGym CreateSession ({ability[:200]})",
                    )
                except grpc.RpcError as exc:
                    if not is_infrastructure(exc):
                        raise  # the row is wrong (unknown env, a config its env cannot start)
                    reason = getattr(exc, "reason", "") or exc
                    raise InfrastructureFailure(f"CreateSession failed: {reason}") from exc
                session.session_id, session.target = created.session_id, self.target
            action = {"name": self.name, "parameters": parameters}
            index = session.step_index
            try:  # with its index: a resend the runtime applied already is answered, not applied
                result = await self._outage().call_async(
                    lambda: client.step(session.session_id, action, step_index=index),
                    f"CodeGym Step {index} of session {session.session_id}",
                )
            except STEP_FAULTS as exc:  # the step rule (errors.py): the runtime's doing, never the model's
                raise InfrastructureFailure(f"Step failed: {getattr(exc, 'reason', '') or exc}") from exc
            session.step_index = int(result.step_index)
            ended = bool(result.done or result.truncated)
            if ended:
                self._remember_end(request_id, float(result.reward))
                await self._close(request_id)
        reward = float(result.reward) if ended else 0.0
        metrics = {"done": bool(result.done), "truncated": bool(result.truncated), "step": result.step_index}
        return ToolResponse(text=str(result.observation)), reward, metrics

    def _outage(self) -> Outage:
        """The process's clock of this tool's runtime (`shared_outage`): an outage is waited out
        once by every episode's calls, not once per call."""
        return shared_outage(self.target, self.outage_wait_s)

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        """The ended episode's reward, by request id (`agent_data`) or instance id; else 0.0."""
        agent_data = kwargs.get("agent_data")
        return self._ended.get(str(getattr(agent_data, "request_id", "") or instance_id), 0.0)

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        # One call ends, not the episode: the session stays (see the module's docstring).
        self._abilities.pop(instance_id, None)

    @classmethod
    def _remember_end(cls, request_id: str, reward: float) -> None:
        cls._ended[request_id] = reward
        while len(cls._ended) > ENDED_KEPT:
            cls._ended.pop(next(iter(cls._ended)))

    async def _make_room(self, keep: str) -> None:
        """Close least recently used sessions (none in a call, not `keep`'s) while more than
        `max_sessions` are held; their episodes (most likely ones verl cut short) cannot go on."""
        while len(self._sessions) > self.max_sessions:
            victim = next((r for r, s in self._sessions.items() if r != keep and not s.lock.locked()), None)
            if victim is None:
                log.warning("CodeGymTool holds %d sessions, all in a call: none closed", len(self._sessions))
                return
            session = self._sessions[victim]
            log.warning(
                "CodeGymTool holds %d sessions (max_sessions=%d): closing session %s of episode %s, "
                "unused for %.0f s",
                len(self._sessions),
                self.max_sessions,
                session.session_id or "(not opened)",
                victim,
                time.monotonic() - session.used,
            )
            self._evicted[victim] = session.session_id
            while len(self._evicted) > ENDED_KEPT:
                self._evicted.pop(next(iter(self._evicted)))
            await self._close(victim)

    async def _close(self, request_id: str) -> None:
        session = self._sessions.pop(request_id, None)
        if session is None or not session.session_id:
            return
        client = shared_client(session.target or self.target, self.timeout_s)
        try:
            await shared_outage(session.target or self.target, self.outage_wait_s).call_async(
                lambda: client.close_session(session.session_id),
                f"CodeGym CloseSession {session.session_id}",
            )
        except grpc.RpcError as exc:  # the runtime's idle expiry reclaims it
            log.warning("could not close CodeGym session %s: %s", session.session_id, exc)

    async def close_idle(self, idle_s: float) -> None:
        """Close the sessions no call has used for `idle_s` seconds (episodes verl cut short)."""
        now = time.monotonic()
        for request_id, session in list(self._sessions.items()):
            if now - session.used >= idle_s and not session.lock.locked():
                await self._close(request_id)

    async def close_all(self) -> None:
        """Close every session this process holds (at the end of a rollout or of training)."""
        await self.close_idle(0.0)


def _ability(agent_data: Any) -> str:
    for entry in (getattr(agent_data, "tools_kwargs", None) or {}).values():
        ability = ((entry or {}).get("create_kwargs") or {}).get("ability")
        if isinstance(ability, str):
            return ability
    return ""
