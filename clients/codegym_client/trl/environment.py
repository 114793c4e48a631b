"""The environments TRL's `GRPOTrainer` plays: `CodeGymEnvironment`, one generated subclass per
environment (`environment_class`) with a method per tool, each instance one runtime session at a
time, and `skip_failed_episodes` for reward functions of the user's own. See the package docstring
(codegym_client/trl/__init__.py) for what TRL does with them, and for outages and failures."""

from __future__ import annotations

import functools
import inspect
import json
import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from codegym_client.abilities import ABILITY_FORMAT, ability_env_id
from codegym_client.errors import (
    STEP_FAULTS,
    CodeGymError,
    EpisodeEnded,
    EpisodeFailed,
    InfrastructureFailure,
    is_infrastructure,
)
from codegym_client.outages import DEFAULT_OUTAGE_WAIT_S, Outage, clears_by_itself
from codegym_client.runtime_client import RuntimeClient
from codegym_client.trl.tools import ToolSchema, tool_method

log = logging.getLogger(__name__)


class Run:
    """The trainer's run as the spec's environments name it to the runtime, which records each
    finished episode's outcome against it (`Stats`, `SampleTasks`). `run_id` is the spec's own
    (`CodeGymSpec(run_id=...)`), else the trainer's run name, which `CodeGymSpec.callback()` reads
    at `on_train_begin`; `policy_version` is the trainer's global step (the optimizer updates the
    policy has had), which the callback sets before each step, so the episodes a step generates
    carry the version of the weights that play them. Without the callback: the spec's run id (or
    none) and no version."""

    def __init__(self, run_id: str = "") -> None:
        self.run_id = run_id
        self.named = bool(run_id)  # given to the spec: the trainer's run name does not replace it
        self.policy_version: int | None = None
        self.prompts_per_generation = 0  # GRPOTrainer's unique prompts per generation batch


class _Session:
    """The session an instance holds and its episode's outcome, closable without the instance (its
    finalizer holds this). The tool methods step it (`call_tool`): it, not the instance, has the
    public method, since TRL takes every public method of an environment as a tool."""

    def __init__(self, client: Callable[[], RuntimeClient], outage: Outage) -> None:
        self.client = client
        self.outage = outage
        self.session_id = ""
        self.lock = threading.Lock()
        self.done = False
        self.reward = 0.0
        self.step_index = 0  # the session's step index, from the runtime's replies
        self.failure: BaseException | None = None

    def restart(self) -> None:
        """Close the session and forget the episode's outcome (before the next one starts)."""
        self.close()
        self.done, self.reward, self.step_index, self.failure = False, 0.0, 0, None

    def fail(self, what: str, exc: BaseException) -> None:
        """End the episode as failed by the infrastructure: unscored, its session closed."""
        self.failure = exc
        log.error(
            "CodeGym %s failed (%s): the episode ends unscored (get_reward() is None)",
            what,
            getattr(exc, "reason", "") or exc,
        )
        self.close()

    def call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        """Step the session with one tool call (`ToolCaller`, what a tool method calls)."""
        if self.failure is not None:
            raise EpisodeFailed(f"the episode failed in the runtime: {name} was not run") from self.failure
        session_id = self.session_id
        if self.done:
            raise EpisodeEnded(f"the episode has ended: {name} was not run")
        if not session_id:
            raise EpisodeEnded("no episode: reset() first")
        action = json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)
        index = self.step_index
        client = self.client()
        try:  # with its index: a step sent again that the runtime applied already is answered, not applied
            response = self.outage.call(
                lambda: client.step(session_id, action, step_index=index),
                f"CodeGym Step {index} of session {session_id}",
            )
        except STEP_FAULTS as exc:  # the step rule (errors.py): the request is ours, never the model's
            self.fail(f"Step {index} of session {session_id}", exc)
            raise EpisodeFailed(
                f"the CodeGym runtime could not serve this episode ({getattr(exc, 'reason', '') or exc}); "
                "it is not scored"
            ) from exc
        self.step_index = int(response.step_index)
        self.reward = float(response.reward)
        if response.done or response.truncated:
            self.done = True
            self.close()
        return str(response.observation)

    def close(self, wait_s: float | None = None) -> None:
        """Close the session, riding out an outage for what is left of the wait (`wait_s`: at most
        that long; the finalizer sends it once, so that an exit does not wait out an outage)."""
        with self.lock:
            session_id, self.session_id = self.session_id, ""
        if not session_id:
            return
        try:
            self.outage.call(
                lambda: self.client().close_session(session_id),
                f"CodeGym CloseSession of session {session_id}",
                wait_s,
            )
        except CodeGymError as exc:  # the runtime's idle expiry reclaims it
            log.warning("could not close CodeGym session %s: %s", session_id, exc)
        except ValueError:  # the channel was closed (interpreter exit): the session expires
            log.warning("could not close CodeGym session %s: client closed", session_id)


class CodeGymEnvironment:
    """Base of the generated environment classes (one per environment, see `environment_class`).

    Subclasses add one method per tool. Public members are only `reset`, `get_reward` and the tools,
    because TRL takes every other public method as a tool."""

    env_ids: frozenset[str] = frozenset()  # the environments whose rows this class plays (empty: any)
    tool_schemas: tuple[ToolSchema, ...] = ()
    _client_factory: Callable[[], RuntimeClient]
    _max_steps: int = 0
    _outage: Outage
    _run: Run = Run()

    def __init__(self) -> None:
        # Opens nothing: TRL builds one instance just to read its tools.
        self._session = _Session(type(self)._client_factory, type(self)._outage)
        # Also runs at exit (atexit): one send, no outage wait there.
        self._finalizer = weakref.finalize(self, self._session.close, 0.0)

    def reset(self, **row: Any) -> str:
        """Start an episode on the row's `ability`; returns the task text and the first observation."""
        self._session.restart()
        ability = row.get("ability")
        if not isinstance(ability, str):
            raise ValueError(f"the row has no 'ability' ({ABILITY_FORMAT})")
        env_id = ability_env_id(ability)
        if self.env_ids and env_id not in self.env_ids:
            raise ValueError(f"{type(self).__name__} plays {sorted(self.env_ids)}, not {env_id}")
        client = self._session.client()
        run = type(self)._run
        try:
            created = self._session.outage.call(
                lambda: client.create_session(
                    ability=ability,
                    max_steps=self._max_steps,
                    run_id=run.run_id,
                    policy_version=run.policy_version,
                ),
                f"CodeGym CreateSession of {env_id}",
            )
        except CodeGymError as exc:
            if not is_infrastructure(exc):
                raise  # EnvNotFound, EnvFailed, InvalidRequest: the data is wrong, the same call fails again
            if clears_by_itself(exc):  # the runtime has served nothing for the whole wait
                log.error(
                    "CodeGym CreateSession of %s: the runtime served no call for outage_wait_s=%g s (%s); "
                    "ending the run",
                    env_id,
                    self._session.outage.wait_s,
                    exc.reason or exc,
                )
                raise InfrastructureFailure(
                    f"CreateSession failed: {exc.reason or exc} (the runtime served no call for "
                    f"outage_wait_s={self._session.outage.wait_s:g} s)"
                ) from exc
            self._session.fail("CreateSession", exc)
            return (
                f"The environment could not be started ({exc.reason or 'runtime error'}); "
                "this episode is not scored."
            )
        with self._session.lock:
            self._session.session_id = created.session_id
        text = created.task_text
        return f"{text}\n\n{created.observation}" if created.observation else text

    def get_reward(self) -> float | None:
        """The episode's reward (the final one once it ended: 1.0 for a right answer); None when
        the runtime failed the episode (TRL then leaves the rollout unscored)."""
        if self._session.failure is not None:
            return None
        return self._session.reward

    def __repr__(self) -> str:
        return f"<{type(self).__name__} session={self._session.session_id or None}>"


def skip_failed_episodes(reward_func: Callable[..., Any]) -> Callable[..., Any]:
    """A reward function of your own (sync or async), giving None for the rollouts whose CodeGym
    episode failed in the runtime: TRL leaves a rollout unscored only when every reward function
    gives None, so a shaping reward next to `get_reward` must be wrapped in this. Reads the
    `environments` TRL passes to reward functions (without them, the rewards pass unchanged)."""

    def blank(rewards: Sequence[Any], environments: Any) -> list[Any]:
        if environments is None:
            return list(rewards)
        return [
            None if isinstance(env, CodeGymEnvironment) and env._session.failure is not None else reward
            for reward, env in zip(rewards, environments, strict=True)
        ]

    if inspect.iscoroutinefunction(reward_func):

        @functools.wraps(reward_func)
        async def scored_async(*args: Any, **kwargs: Any) -> list[Any]:
            return blank(await reward_func(*args, **kwargs), kwargs.get("environments"))

        return scored_async

    @functools.wraps(reward_func)
    def scored(*args: Any, **kwargs: Any) -> list[Any]:
        return blank(reward_func(*args, **kwargs), kwargs.get("environments"))

    return scored


def class_name(env_id: str) -> str:
    name = env_id.rpartition("__")[2] or env_id
    name = "".join(c if c.isalnum() or c == "_" else "_" for c in name)
    return name if name.isidentifier() else f"Env_{name}"


def environment_class(
    name: str,
    tool_schemas: Sequence[ToolSchema],
    client_factory: Callable[[], RuntimeClient],
    *,
    env_ids: Iterable[str] = (),
    max_steps: int = 0,
    outage_wait_s: float = DEFAULT_OUTAGE_WAIT_S,
    outage: Outage | None = None,
    run: Run | None = None,
) -> type[CodeGymEnvironment]:
    """A `CodeGymEnvironment` subclass with one method per tool of `tool_schemas`; its calls ride
    out an outage for `outage_wait_s` (classes given one `outage` share its wait instead); its
    sessions are created for `run` (the spec's run id and policy version)."""
    namespace: dict[str, Any] = {
        "env_ids": frozenset(env_ids),
        "tool_schemas": tuple(tool_schemas),
        "_client_factory": staticmethod(client_factory),
        "_max_steps": max_steps,
        "_outage": outage if outage is not None else Outage(outage_wait_s),
        "_run": run if run is not None else Run(),
        "__module__": "codegym_client.trl",  # where users import the adapter from
        "__doc__": f"CodeGym environment {', '.join(sorted(env_ids)) or name} for TRL: one method per tool.",
    }
    for schema in tool_schemas:
        method = tool_method(schema)
        if method.__name__ in namespace:
            raise ValueError(f"tool {method.__name__!r} is defined twice")
        namespace[method.__name__] = method
    return type(name, (CodeGymEnvironment,), namespace)
