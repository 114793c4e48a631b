"""Remote sessions behind familiar interfaces.

- `RemoteEnv`: a `gymnasium.Env` whose observations and actions are strings, over one runtime
  session, for trainers that drive gymnasium environments (needs gymnasium: install
  `codegym-client[gym]`).
- `OnlineGymEnv` (from `codegym_client.online`, re-exported here): a drop-in for trainers written against
  CodeGym's online client (`from_env_str`, `step(action) -> str`, `finished`, `reward`,
  `release()`); it needs nothing but the client.

Both raise the typed errors of `codegym_client.errors` (`SessionNotFound`, `InvalidRequest`,
`CapacityExceeded`, `RuntimeUnavailable`...; all `CodeGymError`s); `OnlineGymEnv.step` answers a
step after the end as observation text, as CodeGym's own client does. Both send each step with the
session's step index, so a step whose reply was lost is sent again (to another replica when several
are given) without being applied twice.
"""

from __future__ import annotations

import contextlib
import string
from collections.abc import Sequence
from typing import Any

try:
    import gymnasium
    from gymnasium import spaces
except ModuleNotFoundError as exc:
    if exc.name != "gymnasium":
        raise
    raise ModuleNotFoundError(
        "RemoteEnv needs gymnasium: pip install 'codegym-client[gym]'", name="gymnasium"
    ) from exc

from codegym_client.actions import tool_call_action
from codegym_client.api.runtime.v1 import runtime_service_pb2 as rt
from codegym_client.errors import CodeGymError
from codegym_client.online import OnlineGymEnv
from codegym_client.requests import DEFAULT_TARGET, ActionLike
from codegym_client.runtime_client import RuntimeClient

__all__ = ["OnlineGymEnv", "RemoteEnv"]

MAX_TEXT = 1 << 20
TEXT_CHARSET = string.printable


class RemoteEnv(gymnasium.Env[str, str]):
    """One runtime session as a gymnasium environment.

    `reset()` opens the session (or resets it to its own task); `reset(options={"ability": ...})`
    or `{"env_id": ..., "config": ...}` moves to another task; `reset(seed=N)` reopens with that
    seed. `info` carries the tool list, task text, step index and any typed step error.

    `fork()` (and `forks(n)`) continues the episode as new environments from its last committed step
    (or `at_step`, with `keep_history=True`); `checkpoint()` seals it as bytes and
    `RemoteEnv.restore(blob)` brings it back, anywhere the deployment's key is (docs/fork.md).
    """

    metadata = {"render_modes": []}  # noqa: RUF012 (gymnasium declares it a plain attribute)

    def __init__(
        self,
        client: RuntimeClient | str | Sequence[str] = DEFAULT_TARGET,
        *,
        ability: str = "",
        env_id: str = "",
        config: dict[str, Any] | None = None,
        env_str: str = "",
        max_steps: int = 0,
        step_timeout_ms: int = 0,
        keep_history: bool = False,
    ) -> None:
        self._owns_client = not isinstance(client, RuntimeClient)
        self.client = client if isinstance(client, RuntimeClient) else RuntimeClient(client)
        self.task: dict[str, Any] = {
            "ability": ability,
            "env_id": env_id,
            "config": config,
            "env_str": env_str,
        }
        self.options: dict[str, Any] = {
            "max_steps": max_steps,
            "step_timeout_ms": step_timeout_ms,
            "keep_history": keep_history,
        }
        self.observation_space = spaces.Text(MAX_TEXT, charset=TEXT_CHARSET)
        self.action_space = spaces.Text(MAX_TEXT, charset=TEXT_CHARSET)
        self.session_id = ""
        self.created: rt.CreateSessionResponse | None = None
        # The session's index from the runtime's last answer, sent with each step (see step()).
        self._step_index = 0

    def _info(self) -> dict[str, Any]:
        created = self.created
        assert created is not None
        return {
            "session_id": self.session_id,
            "env_id": created.env_id,
            "tools_text": created.tools_text,
            "tools": [t.json_schema for t in created.tools],
            "task_text": created.task_text,
            "max_steps": created.max_steps,
        }

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        new_task = bool(options) and any(k in options for k in ("ability", "env_id", "env_str"))  # type: ignore[operator]
        if new_task:
            assert options is not None
            self.task = {
                "ability": options.get("ability", ""),
                "env_id": options.get("env_id", ""),
                "config": options.get("config"),
                "env_str": options.get("env_str", ""),
            }
        if self.session_id and not new_task and seed is None:
            observation = self.client.reset(self.session_id)
            self._step_index = 0
            return observation, self._info()
        self._close_session()
        self.created = self.client.create_session(**self.task, **self.options, seed=seed or 0)
        self.session_id = self.created.session_id
        self._step_index = 0
        return self.created.observation, self._info()

    def step(self, action: ActionLike | Any) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """`action`: CodeGym's JSON string, an action dict, or an OpenAI message with `tool_calls`.

        Sent with the session's step index: a step whose reply was lost is sent again by the client
        and answered from the runtime's record if it had been applied, so a replica's death never
        applies an action twice nor ends the episode."""
        if not self.session_id:
            raise RuntimeError("call reset() before step()")
        native = tool_call_action(action)
        response = self.client.step(
            self.session_id, native if native is not None else action, step_index=self._step_index
        )
        self._step_index = response.step_index
        info: dict[str, Any] = {"step_index": response.step_index}
        if response.HasField("error"):
            info["error"] = rt.StepErrorCode.Name(response.error.code)
            info["error_message"] = response.error.message
        terminated = response.done and not response.truncated
        return response.observation, response.reward, terminated, response.truncated, info

    def _continued(self, session: rt.ForkedSession, created: rt.CreateSessionResponse) -> RemoteEnv:
        """Another RemoteEnv on `session` (made by a fork or restore), over the same client."""
        env = RemoteEnv(self.client, **self.task, **self.options)
        env.session_id = session.session_id
        env.created = created
        env._step_index = session.step_index
        return env

    def forks(self, count: int, *, at_step: int | None = None, reseed: bool = False) -> list[RemoteEnv]:
        """`count` environments continuing this episode from its last committed step (or `at_step`):
        each steps on its own; by default each replays this episode's draws (`reseed` for its own).
        They share this environment's client; close each when done."""
        if not self.session_id:
            raise RuntimeError("call reset() before fork()")
        assert self.created is not None
        made = self.client.fork_session(self.session_id, count, at_step, reseed)
        return [self._continued(session, self.created) for session in made]

    def fork(self, *, at_step: int | None = None, reseed: bool = False) -> RemoteEnv:
        """One environment continuing this episode (see `forks`)."""
        return self.forks(1, at_step=at_step, reseed=reseed)[0]

    def checkpoint(self, close: bool = False) -> bytes:
        """The episode as an opaque sealed blob; `close` suspends it (this environment then has no
        session: `RemoteEnv.restore(blob)` continues it)."""
        if not self.session_id:
            raise RuntimeError("call reset() before checkpoint()")
        blob = self.client.checkpoint_session(self.session_id, close)
        if close:
            self.session_id = ""
        return blob

    @classmethod
    def restore(cls, blob: bytes, client: RuntimeClient | str | Sequence[str] = DEFAULT_TARGET) -> RemoteEnv:
        """The episode a `checkpoint()` sealed, as a new environment (its tools and task text read
        from the runtime); each restore of one blob is an episode of its own."""
        env = cls(client)
        session = env.client.restore_session(blob)
        described = env.client.get_env(session.env_id)
        env.task = {"ability": "", "env_id": session.env_id, "config": None, "env_str": ""}
        env.options.update(max_steps=session.max_steps, step_timeout_ms=session.step_timeout_ms)
        env.session_id = session.session_id
        env._step_index = session.step_index
        env.created = rt.CreateSessionResponse(
            session_id=session.session_id,
            tools=described.tools,
            tools_text=described.tools_text,
            task_text=described.task_text,
            env_id=session.env_id,
            max_steps=session.max_steps,
            step_timeout_ms=session.step_timeout_ms,
        )
        return env

    def _close_session(self) -> None:
        if self.session_id:
            with contextlib.suppress(CodeGymError):
                self.client.close_session(self.session_id)
            self.session_id = ""

    def close(self) -> None:
        self._close_session()
        if self._owns_client:
            self.client.close()
