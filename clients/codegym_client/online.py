"""`OnlineGymEnv`: a drop-in for trainers written against CodeGym's online client.

Only the runtime client is needed (grpcio and protobuf): a trainer installs `codegym-client` (no
extra) and plays sessions with this class.

Given several runtime addresses (`target="host:a,host:b"` or a list), an episode survives a
replica's death: each step goes with the session's step index and is sent again (to a replica that
is up) when its reply is lost, and the runtime never applies it twice (see `codegym_client.resend`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from codegym_client.abilities import is_ability
from codegym_client.actions import BEGIN, ActionParseError, parse_function_call, tool_call_action
from codegym_client.api.runtime.v1 import runtime_service_pb2 as rt
from codegym_client.errors import CodeGymError, SessionDone
from codegym_client.requests import DEFAULT_TARGET
from codegym_client.runtime_client import RuntimeClient

__all__ = ["OnlineGymEnv"]


class OnlineGymEnv:
    """Drop-in for CodeGym's online environment client, backed by a runtime session.

    `step()` takes the action as CodeGym's JSON string (or a whole model turn holding a
    `<|FunctionCallBegin|>` block) and returns the observation string; refusals and typed errors
    come back as observation text, as a local CodeGym environment would answer them. Failures of
    the infrastructure do not: a step whose reply was lost is resent with its step index, and one
    that still fails raises (`RuntimeUnavailable`...), so it never becomes training text.
    """

    def __init__(self, client: RuntimeClient, created: rt.CreateSessionResponse, owns_client: bool) -> None:
        self.client = client
        self.session_id = created.session_id
        self.env_id = created.env_id
        self.observation = created.observation
        self.tools_text = created.tools_text
        self.task_text = created.task_text
        self.max_steps = created.max_steps
        self.step_count = 0
        # The session's step index as the runtime last answered it: sent with every step, so that
        # a step resent after a lost reply is recognised (kept apart from the public step_count).
        self._step_index = 0
        self._reward = 0.0
        self._finished = False
        self._owns_client = owns_client

    @classmethod
    def from_env_str(
        cls,
        env_str: str,
        target: str | Sequence[str] = DEFAULT_TARGET,
        *,
        client: RuntimeClient | None = None,
        max_steps: int = 0,
        seed: int = 0,
    ) -> OnlineGymEnv:
        """`env_str` is an ability string `codegym_v1@{code_id}__{Env}@{json}` or `Env@{json}`;
        `target` one runtime address or several (comma-separated or a list: round_robin, and a
        lost step goes to another)."""
        owns = client is None
        client = client or RuntimeClient(target)
        try:
            if is_ability(env_str):
                created = client.create_session(ability=env_str, max_steps=max_steps, seed=seed)
            else:
                created = client.create_session(env_str=env_str, max_steps=max_steps, seed=seed)
        except BaseException:
            if owns:
                client.close()
            raise
        return cls(client, created, owns)

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def reward(self) -> float:
        return self._reward

    def step(self, action: str | Any) -> str:
        """A model turn (with a `<|FunctionCallBegin|>` block), a JSON action, or an OpenAI
        assistant message with native `tool_calls` (one call per step)."""
        if not isinstance(action, str):
            try:
                native = tool_call_action(action)
            except ActionParseError as exc:
                return f"Error: {exc}"
            if native is None:
                return "Error: the action is neither text nor a message with tool_calls"
            action = native.to_json()
        elif BEGIN in action:
            try:
                action = parse_function_call(action).to_json()
            except ActionParseError as exc:
                return f"Error: {exc}"
        try:
            response = self.client.step(self.session_id, action, step_index=self._step_index)
        except SessionDone as exc:
            self._finished = True
            return f"Error: {exc.details()}"
        self.step_count = self._step_index = response.step_index
        self._reward = response.reward
        self._finished = response.done
        if response.HasField("error"):
            return f"Error: {response.error.message}"
        return str(response.observation)

    def reset(self) -> str:
        self.observation = self.client.reset(self.session_id)
        self.step_count = self._step_index = 0
        self._reward = 0.0
        self._finished = False
        return self.observation

    def release(self) -> None:
        """Close the session on the server (and the connection if this object opened it)."""
        try:
            self.client.close_session(self.session_id)
        except CodeGymError:
            pass
        finally:
            if self._owns_client:
                self.client.close()

    def __enter__(self) -> OnlineGymEnv:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
