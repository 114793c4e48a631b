"""TRL adapter: CodeGym environments as `GRPOTrainer(environment_factory=...)` environments.

    from codegym_client.trl import CodeGymSpec

    spec = CodeGymSpec("127.0.0.1:50051", instances="train.jsonl")
    trainer = GRPOTrainer(model=..., train_dataset=spec.train_dataset,
                          environment_factory=spec.environment_factory, reward_funcs=spec.reward_funcs)

Built to what TRL's `trl/trainer/grpo_trainer.py` does with an environment factory:

- At construction it calls each factory once (a probe), lists the instance's bound methods with
  `inspect.getmembers` (which also reads every attribute) and takes every public one other than
  `reset` and `get_reward` as a tool, rendered for the chat template with
  `transformers.utils.get_json_schema`. So an instance here opens nothing when built, has no public
  method but its tools, `reset` and `get_reward`, and has one method per tool, named after it, with
  keyword-only typed parameters and a Google docstring written from the tool's JSON schema: its
  `get_json_schema` is the tool's schema (for the types CodeGym's schemas use).
- Per batch it draws instances from a pool that it grows and never closes, and calls
  `reset(**row)` with the dataset row (less its `environment` column, with a dict factory); the
  string `reset` returns is appended to the prompt's last user message. Here `reset` closes the
  instance's previous session and opens one from the row's `ability`.
- `_tool_call_loop` calls `tool(**arguments)` and turns any `Exception` a tool raises into a
  `{"error": ...}` tool message the model sees; it has no way to end one rollout early (the model
  goes on until it stops calling tools, `max_tool_calling_iterations` or `max_completion_length`).
  A tool called after the episode ended raises `EpisodeEnded` (an ordinary error: the model's
  doing, shown to it). `reset` is called outside any `try`: what it raises ends the training step.
- Rewards: a reward function's `None` becomes NaN (`_calculate_rewards`), and a rollout for which
  every reward function gave NaN is "unscorable": it is left out of its group's mean and std, and
  its advantage is set to 0 (`torch.nan_to_num`), so it moves the policy by nothing of its own.
  (Its tokens still count in the `dapo` loss's token normalizer, and in the KL term when
  `beta > 0`; TRL offers no way to drop them.) `GRPOTrainer` passes `environments=` (the rollouts'
  instances) to every reward function.
- An environment that defines `get_reward()` owns its reward: TRL adds a reward column calling it
  once per rollout. So `CodeGymSpec.reward_funcs` is an empty list (extend it with shaping rewards
  of your own); passing a reward function of the final reward too would count it twice.
- With a dict factory, rows carry `environment` and only that environment's tools are shown:
  `environment_factory` is a dict keyed by env id when the dataset's environments have different
  tool sets, and one class otherwise.

Outages and failures. Every runtime call an environment makes (create, step, close) goes through
`codegym_client.outages.ride_out` for `outage_wait_s` (10 minutes by default): an outage shorter
than that costs latency, not the episode. Steps are sent with their step index, so a step sent
again after a lost reply is answered from the runtime's record, never applied twice. The
environments of one spec share the wait: an outage is counted from the first call it failed, and
once it has lasted `outage_wait_s` every further call is sent once. Then:

- a step that fails for a reason other than the model's (the outage outlasted the wait, the
  session was lost, e.g. by a runtime restarted with sessions in memory, a refused step) ends
  that episode only: the tool raises `EpisodeFailed` (TRL shows it to the model; every later
  tool of the episode raises it at once) and `get_reward()` returns None, so TRL leaves the
  rollout unscored (above). Reward functions of your own must give None for it too, or TRL
  scores it with theirs: wrap them in `skip_failed_episodes`.
- `reset` that cannot open a session because the runtime has served nothing for the whole wait
  raises `InfrastructureFailure`, a `BaseException`: the run ends, as the last resort. Any other
  infrastructure failure at create (the runtime answered INTERNAL, say) fails that episode
  only, as a step's does.

Sessions: a session ends when its episode ends (the step that ends it closes it), on the next
`reset`, when the instance is collected (`weakref.finalize`) and at interpreter exit (the same
finalizer, run by `atexit`), so a run leaves none open in the runtime. The finalizer sends its
close once (an exit does not wait out an outage: the runtime's idle expiry reclaims what it missed).

Runs: each session is created with the spec's run id and the trainer's global step as its policy
version (`CodeGymSpec(run_id=...)`, else the trainer's run name; `spec.callback()`, a
`TrainerCallback`, carries both from the trainer), which the runtime records with the episode's
outcome. `spec.curriculum()` streams rows the runtime chooses from that record (`Curriculum`).

Needs nothing beyond the client: `datasets`, when importable, makes `train_dataset` a
`datasets.Dataset` (else a list of dicts); `transformers` is only TRL's.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib
import inspect
import json
import keyword
import logging
import random
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import grpc

from codegym_client.errors import CodeGymError, EpisodeEnded, EpisodeFailed, InfrastructureFailure
from codegym_client.outages import DEFAULT_OUTAGE_WAIT_S, clears_by_itself, ride_out
from codegym_client.requests import DEFAULT_TARGET
from codegym_client.runtime_client import RuntimeClient

__all__ = [
    "ABILITY_PREFIX",
    "CodeGymEnvironment",
    "CodeGymSpec",
    "Curriculum",
    "ToolSchema",
    "environment_class",
    "skip_failed_episodes",
]

log = logging.getLogger(__name__)

ABILITY_PREFIX = "codegym_v1"
RESERVED = frozenset({"reset", "get_reward"})  # the names TRL does not take as tools
# GetEnv calls a spec keeps in flight while it builds (`CodeGymSpec(getenv_concurrency=...)`), and
# the ListEnvs page it asks for (the runtime's largest).
GETENV_CONCURRENCY = 8
LIST_PAGE_SIZE = 1000
PARQUET_BATCH_ROWS = 4096  # rows of an instances file read at a time

ToolSchema = dict[str, Any]  # an OpenAI tool definition: {"type": "function", "function": {...}}


def ability_env_id(ability: str) -> str:
    """The env id of `codegym_v1@{code_id}__{Env}@{config}` (ValueError when it is not one)."""
    prefix, _, rest = ability.partition("@")
    env_id, sep, _ = rest.partition("@")
    if prefix != ABILITY_PREFIX or not sep or not env_id:
        raise ValueError(
            f"not an ability string 'codegym_v1@{{code_id}}__{{Env}}@{{config}}': {ability[:80]!r}"
        )
    return env_id


# -- Tool methods from JSON schemas --------------------------------------------------------------

_SCALARS: dict[str, Any] = {
    "integer": int,
    "number": float,
    "string": str,
    "boolean": bool,
    "null": type(None),
    "array": list,
    "object": dict,
}


def _hint(schema: Mapping[str, Any]) -> Any:
    """The type hint `transformers.utils.get_json_schema` turns back into `schema` (less its
    description): `int`, `list[int]`, `int | str`, `Any` for an empty schema..."""
    kind = schema.get("type")
    if kind is None:
        return Any
    if isinstance(kind, list):
        hints = [_hint({"type": k}) for k in kind]
        union = hints[0]
        for h in hints[1:]:
            union = union | h
        return union
    if kind == "array" and isinstance(schema.get("items"), Mapping) and schema["items"]:
        return list[_hint(schema["items"])]  # type: ignore[misc]
    if kind == "object" and isinstance(schema.get("additionalProperties"), Mapping):
        return dict[str, _hint(schema["additionalProperties"])]  # type: ignore[misc]
    return _SCALARS.get(str(kind), Any)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _docstring(description: str, properties: Mapping[str, Any]) -> str:
    """A Google docstring whose `get_json_schema` parse is `description` and the properties'
    descriptions (one line each: transformers joins an argument's lines with spaces anyway)."""
    lines = [description.strip()]
    if properties:
        lines += ["", "Args:"]
        lines += [f"    {name}: {_one_line(str(p.get('description', '')))}" for name, p in properties.items()]
    return "\n".join(lines)


class _Omitted:
    """Default of an optional tool parameter: left out of the action, so the env's own default applies."""

    def __repr__(self) -> str:
        return "<omitted>"


OMITTED: Any = _Omitted()


def _tool_method(schema: ToolSchema) -> Callable[..., str]:
    """One tool as a method `Name(self, *, param: type, ...) -> str` that steps the session."""
    function = schema.get("function", schema)
    name = str(function["name"])
    parameters = function.get("parameters") or {}
    properties: dict[str, Any] = dict(parameters.get("properties") or {})
    required = set(parameters.get("required") or [])
    if not name.isidentifier() or keyword.iskeyword(name) or name.startswith("_") or name in RESERVED:
        raise ValueError(f"tool {name!r} cannot be a method of a TRL environment")
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    annotations: dict[str, Any] = {}
    for arg, arg_schema in properties.items():
        if not arg.isidentifier() or keyword.iskeyword(arg) or arg == "self":
            raise ValueError(f"parameter {arg!r} of tool {name!r} cannot be a Python parameter")
        hint = _hint(arg_schema if isinstance(arg_schema, Mapping) else {})
        default = inspect.Parameter.empty if arg in required else OMITTED
        params.append(
            inspect.Parameter(arg, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=hint)
        )
        annotations[arg] = hint

    def tool(self: CodeGymEnvironment, **arguments: Any) -> str:
        return self._call_tool(name, {k: v for k, v in arguments.items() if v is not OMITTED})

    tool.__name__ = tool.__qualname__ = name
    tool.__doc__ = _docstring(str(function.get("description") or name), properties)
    tool.__annotations__ = annotations  # no "return": get_json_schema would add it to the schema
    tool.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    return tool


# -- The environment -----------------------------------------------------------------------------

T = TypeVar("T")


class _Outage:
    """The runtime's outage as the environments of one spec see it: since when their calls have
    failed for a reason that clears by itself (None: the last call was answered). The calls share
    one wait: an outage is counted from the first call it failed, so a batch of rollouts waits
    `wait_s` once, not once per rollout; after that each call is sent once (with the client's own
    resends) until a call is answered."""

    def __init__(self, wait_s: float) -> None:
        self.wait_s = max(0.0, float(wait_s))
        self.lock = threading.Lock()
        self.since: float | None = None

    def remaining(self) -> float:
        with self.lock:
            if self.since is None:
                return self.wait_s
            return max(0.0, self.since + self.wait_s - time.monotonic())

    def saw(self, exc: BaseException | None) -> None:
        """A call's outcome: answered (`exc` None, or a refusal that does not clear by itself:
        the runtime is up) or not."""
        with self.lock:
            if exc is None or not clears_by_itself(exc):
                self.since = None
            elif self.since is None:
                self.since = time.monotonic()

    def call(self, call: Callable[[], T], what: str, wait_s: float | None = None) -> T:
        """`call()` riding out an outage for what is left of the wait (or `wait_s`)."""

        def attempt() -> T:
            try:
                result = call()
            except grpc.RpcError as exc:
                self.saw(exc)
                raise
            self.saw(None)
            return result

        return ride_out(attempt, what, self.remaining() if wait_s is None else wait_s)


class _Run:
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


def run_name(args: Any) -> str:
    """The run id of a `transformers.TrainingArguments` (GRPOConfig): its `run_name`, else the name
    of its `output_dir` (what a trainer names its run by: the checkpoints' folder)."""
    name = str(getattr(args, "run_name", None) or "")
    if name:
        return name
    return Path(str(getattr(args, "output_dir", None) or "trainer_output")).name


class _Session:
    """The session an instance holds, closable without the instance (its finalizer holds this)."""

    def __init__(self, client: Callable[[], RuntimeClient], outage: _Outage) -> None:
        self.client = client
        self.outage = outage
        self.session_id = ""
        self.lock = threading.Lock()

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
    _outage: _Outage
    _run: _Run = _Run()

    def __init__(self) -> None:
        # Opens nothing: TRL builds one instance just to read its tools.
        self._session = _Session(type(self)._client_factory, type(self)._outage)
        # Also runs at exit (atexit): one send, no outage wait there.
        self._finalizer = weakref.finalize(self, self._session.close, 0.0)
        self._done = False
        self._reward = 0.0
        self._step_index = 0  # the session's step index, from the runtime's replies
        self._failure: BaseException | None = None

    def reset(self, **row: Any) -> str:
        """Start an episode on the row's `ability`; returns the task text and the first observation."""
        self._session.close()
        self._done, self._reward, self._step_index, self._failure = False, 0.0, 0, None
        ability = row.get("ability")
        if not isinstance(ability, str):
            raise ValueError("the row has no 'ability' (codegym_v1@{code_id}__{Env}@{config})")
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
            if not exc.infrastructure:
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
            self._fail("CreateSession", exc)
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
        if self._failure is not None:
            return None
        return self._reward

    def _fail(self, what: str, exc: BaseException) -> None:
        """End the episode as failed by the infrastructure: unscored, its session closed."""
        self._failure = exc
        log.error(
            "CodeGym %s failed (%s): the episode ends unscored (get_reward() is None)",
            what,
            getattr(exc, "reason", "") or exc,
        )
        self._session.close()

    def _call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        if self._failure is not None:
            raise EpisodeFailed(f"the episode failed in the runtime: {name} was not run") from self._failure
        session_id = self._session.session_id
        if self._done:
            raise EpisodeEnded(f"the episode has ended: {name} was not run")
        if not session_id:
            raise EpisodeEnded("no episode: reset() first")
        action = json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)
        index = self._step_index
        client = self._session.client()
        try:  # with its index: a step sent again that the runtime applied already is answered, not applied
            response = self._session.outage.call(
                lambda: client.step(session_id, action, step_index=index),
                f"CodeGym Step {index} of session {session_id}",
            )
        except CodeGymError as exc:  # the request is ours, not the model's: never its doing
            self._fail(f"Step {index} of session {session_id}", exc)
            raise EpisodeFailed(
                f"the CodeGym runtime could not serve this episode ({exc.reason or exc}); it is not scored"
            ) from exc
        self._step_index = int(response.step_index)
        self._reward = float(response.reward)
        if response.done or response.truncated:
            self._done = True
            self._session.close()
        return str(response.observation)

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
            None if isinstance(env, CodeGymEnvironment) and env._failure is not None else reward
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


def _class_name(env_id: str) -> str:
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
    outage: _Outage | None = None,
    run: _Run | None = None,
) -> type[CodeGymEnvironment]:
    """A `CodeGymEnvironment` subclass with one method per tool of `tool_schemas`; its calls ride
    out an outage for `outage_wait_s` (classes given one `outage` share its wait instead); its
    sessions are created for `run` (the spec's run id and policy version)."""
    namespace: dict[str, Any] = {
        "env_ids": frozenset(env_ids),
        "tool_schemas": tuple(tool_schemas),
        "_client_factory": staticmethod(client_factory),
        "_max_steps": max_steps,
        "_outage": outage if outage is not None else _Outage(outage_wait_s),
        "_run": run if run is not None else _Run(),
        "__module__": __name__,
        "__doc__": f"CodeGym environment {', '.join(sorted(env_ids)) or name} for TRL: one method per tool.",
    }
    for schema in tool_schemas:
        method = _tool_method(schema)
        if method.__name__ in namespace:
            raise ValueError(f"tool {method.__name__!r} is defined twice")
        namespace[method.__name__] = method
    return type(name, (CodeGymEnvironment,), namespace)


# -- The spec ------------------------------------------------------------------------------------


def _optional(module: str) -> Any:
    """An optional module (`datasets`: TRL brings it, the client does not need it), or None."""
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


class _Instance:
    """What the spec takes from a training-instance row: its ability, and its `tools` as the row
    has them (`codegym export --tools json|both`), read only for an environment's first row."""

    __slots__ = ("ability", "raw_tools")

    def __init__(self, ability: str, raw_tools: Any) -> None:
        self.ability = ability
        self.raw_tools = raw_tools

    def tools(self) -> list[ToolSchema] | None:
        """The row's tool schemas: a list of OpenAI tool definitions (JSONL, rows given as dicts),
        or that list as a JSON string (`codegym export`'s Parquet); None for anything else (a
        Parquet struct column, as older exports wrote, pads each schema with every other
        environment's parameters: not its tools)."""
        value = self.raw_tools
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                return None
        if isinstance(value, list) and value and all(isinstance(t, dict) for t in value):
            return value
        return None


def _read_instances(instances: str | Path | Iterable[Mapping[str, Any]]) -> Iterator[_Instance]:
    """The rows' abilities (and tools), one row at a time: a file of CodeGym's 80,130 published
    rows is read through, never held (JSONL line by line; Parquet a row group at a time, only the
    `ability` and `tools` columns)."""
    if isinstance(instances, str | Path):
        path = Path(instances)
        if path.suffix == ".parquet":  # `codegym export --out X.parquet`
            yield from _read_parquet(path)
            return
        yield from _read_jsonl(path)
        return
    for row in instances:
        yield _Instance(str(row.get("ability", "")), row.get("tools"))


_ABILITY_FIRST = '{"ability": "'  # how `codegym export` starts a row (json.dumps, keys in order)


def _read_jsonl(path: Path) -> Iterator[_Instance]:
    """A JSONL file's rows, line by line. A row `codegym export` wrote starts with its ability: that
    string is decoded alone (most of a row is its prompt, which the spec does not use), and the
    whole row only for the first row of each environment, for its `tools`; any other row is
    decoded whole."""
    decoder = json.JSONDecoder()
    seen: set[str] = set()
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            try:
                if line.startswith(_ABILITY_FIRST):
                    ability, _ = decoder.raw_decode(line, len(_ABILITY_FIRST) - 1)
                    env_id = ability.partition("@")[2].partition("@")[0]
                    if env_id in seen or '"tools": ' not in line:
                        seen.add(env_id)
                        yield _Instance(ability, None)
                        continue
                    seen.add(env_id)
                elif not line.strip():
                    continue
                row = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{path}:{number}: not a JSON row: {exc}") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{number}: not a JSON object")
            yield _Instance(str(row.get("ability", "")), row.get("tools"))


def _read_parquet(path: Path) -> Iterator[_Instance]:
    """A Parquet file's rows, `PARQUET_BATCH_ROWS` at a time: every ability, and `tools` only from
    the first row of each environment (the rest are never made Python objects)."""
    parquet = _optional("pyarrow.parquet")
    if parquet is None:  # `datasets` (TRL's) brings pyarrow
        raise ValueError(f"{path}: reading Parquet needs `pyarrow` (or `datasets`); or export JSONL")
    file = parquet.ParquetFile(str(path))
    names = set(file.schema_arrow.names)
    if "ability" not in names:
        raise ValueError(f"{path}: no 'ability' column")
    columns = ["ability", "tools"] if "tools" in names else ["ability"]
    seen: set[str] = set()
    for batch in file.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=columns):
        abilities = [str(a or "") for a in batch.column(0).to_pylist()]
        firsts: dict[int, Any] = {}
        if len(columns) == 2:
            for i, ability in enumerate(abilities):
                env_id = ability.partition("@")[2].partition("@")[0]
                if env_id not in seen:
                    seen.add(env_id)
                    firsts[i] = None
            if firsts:
                taken = batch.column(1).take(list(firsts)).to_pylist()
                firsts = dict(zip(firsts, taken, strict=True))
        for i, ability in enumerate(abilities):
            yield _Instance(ability, firsts.get(i))


class CodeGymSpec:
    """What `GRPOTrainer` takes to train on CodeGym environments served by a runtime at `target`.

    Tasks come from `instances` (training-instance rows with an `ability`, a JSONL/Parquet path or
    the rows themselves, e.g. `codegym export`'s file) or from the runtime's own `library` (its task
    configs: `True` for every environment, an env-id prefix, or a list of env ids). Building a spec
    opens no session. Tool schemas come from the rows when they carry them (`codegym export --tools
    json|both`) and the runtime lists their environments with the same tool names (`ListEnvs`), else
    from the runtime (`GetEnv`, one call per environment, `getenv_concurrency` in flight: for
    CodeGym's 22,366 environments, export with `--tools json` and give the file). A file is read
    through, never held: JSONL line by line (the ability only, where the row starts with it, as
    `codegym export` writes it), Parquet its `ability` and `tools` columns a batch at a time.

    - `train_dataset`: one row per task, `prompt` (a user message holding `instruction`; TRL appends
      what `reset` returns: the task and the first observation), `ability`, `env_id`, and
      `environment` when `environment_factory` is a dict. A `datasets.Dataset` when `datasets` is
      importable, else a list of dicts.
    - `environment_factory`: a class (one set of tools) or a dict {env id: class}; call it for an
      instance. `environment_classes` maps every env id to its class.
    - `reward_funcs`: `[]`: the environments own their reward (`get_reward`), which TRL adds itself.
      Reward functions of your own go in wrapped in `skip_failed_episodes`.

    `outage_wait_s` (an operator's setting, 10 minutes by default): how long the environments' calls
    ride out an outage of the runtime before its failure ends anything (see the module docstring:
    a failed episode is left unscored; a `reset` after an outage of the whole wait ends the run).
    Building a spec (`GetEnv`, `ListEnvs`) waits out an outage for `outage_wait_s` too (a run
    started while the runtime restarts); an environment the runtime does not have fails at once.
    """

    def __init__(
        self,
        target: str | Sequence[str] = DEFAULT_TARGET,
        *,
        instances: str | Path | Iterable[Mapping[str, Any]] | None = None,
        library: bool | str | Sequence[str] | None = None,
        instruction: str = "",
        max_steps: int = 0,
        timeout_s: float = 60.0,
        client: RuntimeClient | None = None,
        outage_wait_s: float = DEFAULT_OUTAGE_WAIT_S,
        getenv_concurrency: int = GETENV_CONCURRENCY,
        run_id: str = "",
    ) -> None:
        if (instances is None) == (library is None or library is False):
            raise ValueError("give exactly one of instances= and library=")
        self.target = target
        self._client = client
        self._client_lock = threading.Lock()
        self._timeout_s = timeout_s
        self.outage_wait_s = outage_wait_s
        self._outage = _Outage(outage_wait_s)  # one wait for all of the spec's environments
        self.run = _Run(run_id)  # the run and policy version its sessions are created for
        self._tools: dict[str, list[ToolSchema]] = {}  # from GetEnv, asked once per environment
        self.getenv_concurrency = max(1, int(getenv_concurrency))
        if instances is not None:
            with _gc_paused():  # the rows' abilities and their tools: kept
                abilities, given = self._instance_rows(instances)
        else:
            abilities, given = self._library_rows(library), {}
        if not abilities:
            raise ValueError("no tasks: the instances or the library selection is empty")
        env_ids = list(dict.fromkeys(ability_env_id(a) for a in abilities))
        schemas = self._schemas(env_ids, given)
        self._tools.clear()  # the classes hold them now
        self.environment_classes: dict[str, type[CodeGymEnvironment]] = {}
        self.environment_factory: type[CodeGymEnvironment] | dict[str, type[CodeGymEnvironment]]
        self.rows: list[dict[str, Any]] = []
        with _gc_paused():  # a class per environment, a row per task: none of it garbage
            tool_sets = {json.dumps(s, sort_keys=True) for s in schemas.values()}
            if len(tool_sets) == 1:  # one set of tools: one class plays every row
                name = _class_name(env_ids[0]) if len(env_ids) == 1 else "CodeGymEnv"
                shared = environment_class(
                    name,
                    schemas[env_ids[0]],
                    self.client,
                    env_ids=env_ids,
                    max_steps=max_steps,
                    outage=self._outage,
                    run=self.run,
                )
                self.environment_classes = dict.fromkeys(env_ids, shared)
                self.environment_factory = shared
            else:
                names: set[str] = set()
                for env_id in env_ids:
                    name = _class_name(env_id)
                    if name in names:  # TRL names a reward column after the class: keep them apart
                        name = _class_name(env_id.replace("__", "_"))
                    names.add(name)
                    self.environment_classes[env_id] = environment_class(
                        name,
                        schemas[env_id],
                        self.client,
                        env_ids=[env_id],
                        max_steps=max_steps,
                        outage=self._outage,
                        run=self.run,
                    )
                self.environment_factory = dict(self.environment_classes)
            self._content = f"{instruction}\n\n" if instruction else ""
            self.rows.extend(self.row(ability) for ability in abilities)
        self.reward_funcs: list[Callable[..., list[float | None]]] = []

    def client(self) -> RuntimeClient:
        """The spec's client (one channel, shared by its environments), made on first use."""
        with self._client_lock:
            if self._client is None:
                self._client = RuntimeClient(self.target, timeout_s=self._timeout_s)
            return self._client

    @property
    def train_dataset(self) -> Any:
        """The rows as a `datasets.Dataset` when `datasets` is importable, else a list of dicts."""
        datasets = _optional("datasets")
        if datasets is None:
            return [dict(r) for r in self.rows]
        return datasets.Dataset.from_list(self.rows)

    def row(self, ability: str) -> dict[str, Any]:
        """The dataset row of a task (`train_dataset`'s shape): prompt, ability, env id, and
        `environment` with a dict factory. The task's environment must be one of the spec's."""
        env_id = ability_env_id(ability)
        out: dict[str, Any] = {"prompt": [{"role": "user", "content": self._content}], "ability": ability}
        out["env_id"] = env_id
        if isinstance(self.environment_factory, dict):
            out["environment"] = env_id
        return out

    def callback(self) -> Any:
        """A `transformers.TrainerCallback` for `GRPOTrainer(callbacks=[spec.callback()])`: it names
        the spec's sessions after the trainer's run (`args.run_name`, else the `output_dir`'s name;
        a `run_id` given to the spec stays) and its global step (the policy's version), which the
        runtime records with each episode's outcome. TRL builds environments with no arguments, so
        this is how the trainer's state reaches them. Needs `transformers` (TRL's)."""
        return _run_callback(self.run)

    def curriculum(self, *, prompts_per_draw: int = 0, seed: int = 0, **options: Any) -> Any:
        """A `datasets.IterableDataset` of rows (`train_dataset`'s shape) drawn from the runtime's
        record for the spec's run (`SampleTasks`), one draw at a time: give it to `GRPOTrainer` as
        `train_dataset`, with `callbacks=[spec.callback()]` and `GRPOConfig(max_steps=...,
        shuffle_dataset=False)`. See `Curriculum`."""
        datasets = _optional("datasets")
        if datasets is None:
            raise ValueError("the curriculum dataset needs `datasets` (TRL brings it)")
        source = Curriculum(self, prompts_per_draw=prompts_per_draw, seed=seed, **options)
        key = len(_CURRICULA)
        _CURRICULA[key] = source
        return datasets.IterableDataset.from_generator(_curriculum_rows, gen_kwargs={"key": key})

    def _get_env(self, env_id: str) -> Any:
        """GetEnv's answer for `env_id`; its tool schemas are kept (library rows and tool schemas
        both need it: asked once)."""
        client = self.client()  # a run started while the runtime restarts waits for it, on the spec's clock
        env = self._outage.call(lambda: client.get_env(env_id), f"CodeGym GetEnv {env_id}")
        self._tools[env_id] = [json.loads(t.json_schema) for t in env.tools]
        return env

    def _each_env(self, env_ids: Sequence[str], use: Callable[[Any], T]) -> list[T]:
        """`use(GetEnv's answer)` for each of `env_ids`, in order, with up to `getenv_concurrency`
        calls in flight: one RPC per environment, and a library of 22,366 asked one at a time
        waits out as many round trips. Only what `use` returns is kept; the first failure is
        raised and the calls not yet sent are dropped."""
        if len(env_ids) < 2 or self.getenv_concurrency < 2:
            return [use(self._get_env(env_id)) for env_id in env_ids]
        self.client()  # made once, before the threads share it
        pool = ThreadPoolExecutor(self.getenv_concurrency, thread_name_prefix="codegym-getenv")
        try:
            futures = [pool.submit(lambda e: use(self._get_env(e)), env_id) for env_id in env_ids]
            return [future.result() for future in futures]
        finally:  # after a failure (or Ctrl-C), the calls in flight end on their own
            pool.shutdown(wait=False, cancel_futures=True)

    def _instance_rows(
        self, instances: str | Path | Iterable[Mapping[str, Any]]
    ) -> tuple[list[str], dict[str, list[ToolSchema]]]:
        """The rows' abilities, and the tool schemas the rows carry, by env id (the first row of
        each environment that has them)."""
        abilities: list[str] = []
        given: dict[str, list[ToolSchema]] = {}
        first: set[str] = set()
        for row in _read_instances(instances):
            abilities.append(row.ability)
            if row.raw_tools is not None:
                env_id = ability_env_id(row.ability)
                if env_id not in first:
                    first.add(env_id)
                    tools = row.tools()
                    if tools is not None:
                        given[env_id] = tools
        return abilities, given

    def _schemas(self, env_ids: list[str], given: dict[str, list[ToolSchema]]) -> dict[str, list[ToolSchema]]:
        """Each environment's tool schemas. The rows' own (`codegym export --tools json|both`) where
        the runtime lists the environment with the same tool names (`ListEnvs`, a page per 1,000
        environments); GetEnv's for every other environment (it fails at once for one the runtime
        does not have), with up to `getenv_concurrency` calls in flight."""
        schemas: dict[str, list[ToolSchema]] = {}
        if given:
            names = self._tool_names(_common_prefix(given))
            for env_id, tools in given.items():
                listed = names.get(env_id)
                if listed is not None and listed == [_tool_name(t) for t in tools]:
                    schemas[env_id] = tools
            stale = sum(1 for env_id in given if env_id in names and env_id not in schemas)
            if stale:
                log.warning(
                    "%d environments' tools in the instances differ from the runtime's: using the "
                    "runtime's (GetEnv); export the instances again",
                    stale,
                )
        for env_id in env_ids:  # asked already for the library's rows
            if env_id not in schemas and env_id in self._tools:
                schemas[env_id] = self._tools[env_id]
        self._each_env([env_id for env_id in env_ids if env_id not in schemas], lambda env: None)
        return {env_id: schemas.get(env_id) or self._tools[env_id] for env_id in env_ids}

    def _tool_names(self, prefix: str) -> dict[str, list[str]]:
        """The tool names of every environment of `prefix` the runtime lists, by env id."""
        client = self.client()
        listed = self._outage.call(
            lambda: list(client.list_envs(prefix=prefix, page_size=LIST_PAGE_SIZE)), "CodeGym ListEnvs"
        )
        return {e.env_id: list(e.tool_names) for e in listed}

    def _library_rows(self, library: bool | str | Sequence[str] | None) -> list[str]:
        client = self.client()
        if isinstance(library, str) or library is True:
            prefix = "" if library is True else str(library)
            listed = self._outage.call(
                lambda: list(client.list_envs(prefix=prefix, page_size=LIST_PAGE_SIZE)), "CodeGym ListEnvs"
            )
            env_ids = [e.env_id for e in listed if e.task_count]  # an env without tasks gives no row
        else:
            env_ids = list(library or [])

        def abilities(env: Any) -> list[str]:
            return [f"{ABILITY_PREFIX}@{env.env_id}@{task.config_json}" for task in env.tasks]

        return [ability for each in self._each_env(env_ids, abilities) for ability in each]


class Curriculum:
    """The tasks a GRPO run trains on, chosen by the runtime from what its episodes have shown
    (`SampleTasks`: the run's learnable band, a share of tasks it has not seen, none it has
    mastered or that fail for everyone), as rows of the spec's `train_dataset` shape.

    Built to what TRL 1.16's `GRPOTrainer` allows: its `train_dataset` is a `datasets.Dataset` or
    `IterableDataset`. A map-style dataset is read through TRL's `RepeatSampler`, a permutation of
    fixed rows, so rows that change with the record have to stream: `CodeGymSpec.curriculum()`
    wraps `rows()` in an `IterableDataset`, which TRL repeats `num_generations` times per row
    (`repeat_iterable_dataset`), so every rollout of a group plays the same task. What follows:

    - `GRPOConfig(max_steps=...)`: a stream has no length.
    - `shuffle_dataset=False`: TRL shuffles a stream through a buffer of 1,000 rows, which would
      draw that far ahead of training; the runtime's choice is already random (and seeded).
    - One training process: each process reads the stream itself (TRL sets `dispatch_batches=
      False`), so with several they draw apart and Accelerate's slices of one batch mix draws.
    - A draw asks for `prompts_per_draw` tasks (0: the unique prompts of a generation batch,
      `generation_batch_size // num_generations`, which `spec.callback()` reads from the trainer;
      else 64), seeded `seed + k` for the k-th draw: the same seed and record give the same rows.
      Its run is the spec's (`CodeGymSpec(run_id=...)` or the trainer's run name, through the
      callback); `options` are `sample_tasks`' (`low`, `high`, `explore`, `per_env_cap`,
      `min_episodes`; `env_prefix` defaults to what the spec's environments share).
    - Tasks of environments the spec does not have are skipped; a draw left empty falls back to
      the spec's own rows, uniformly (seeded), with a warning.
    """

    DEFAULT_DRAW = 64

    def __init__(
        self, spec: CodeGymSpec, *, prompts_per_draw: int = 0, seed: int = 0, **options: Any
    ) -> None:
        self.spec = spec
        self.prompts_per_draw = int(prompts_per_draw)
        self.seed = int(seed)
        self.options = {"env_prefix": _common_prefix(spec.environment_classes), **options}
        self.draws = 0  # draws taken: the next one is seeded seed + draws

    def rows(self) -> Iterator[dict[str, Any]]:
        """Rows, forever, one draw at a time (each asked for when the previous one is used up)."""
        while True:
            yield from self.draw()

    def draw(self) -> list[dict[str, Any]]:
        """The next draw's rows."""
        run = self.spec.run
        size = self.prompts_per_draw or run.prompts_per_generation or self.DEFAULT_DRAW
        seed = self.seed + self.draws
        self.draws += 1
        client = self.spec.client()
        response = self.spec._outage.call(
            lambda: client.sample_tasks(run.run_id, size, seed=seed, **self.options),
            f"CodeGym SampleTasks for run {run.run_id!r}",
        )
        known = self.spec.environment_classes
        rows = [self.spec.row(task.ability) for task in response.tasks if task.env_id in known]
        if len(rows) < len(response.tasks):
            log.warning(
                "CodeGym curriculum: %d of %d sampled tasks are of environments the spec does not have: skipped",
                len(response.tasks) - len(rows),
                len(response.tasks),
            )
        if not rows:
            log.warning(
                "CodeGym curriculum: the runtime sampled no task of the spec's environments for run %r: "
                "%d of the spec's rows, uniformly",
                run.run_id,
                size,
            )
            chosen = random.Random(seed).choices(self.spec.rows, k=size)
            rows = [dict(row) for row in chosen]
        return rows


# The curricula `CodeGymSpec.curriculum()` made, by key: `datasets` pickles a generator and its
# arguments to fingerprint the dataset, and a curriculum holds the spec's gRPC channel, which does
# not pickle; the generator is a module function and its argument a number.
_CURRICULA: dict[int, Curriculum] = {}


def _curriculum_rows(key: int) -> Iterator[dict[str, Any]]:
    yield from _CURRICULA[key].rows()


def _run_callback(run: _Run) -> Any:
    """`CodeGymSpec.callback()`: a `transformers.TrainerCallback` keeping `run` up to date."""
    transformers = _optional("transformers")
    if transformers is None:
        raise ValueError("the run callback is a transformers.TrainerCallback: install transformers (TRL's)")

    class CodeGymRunCallback(transformers.TrainerCallback):  # type: ignore[name-defined]
        """Names the spec's sessions after the trainer's run and its global step."""

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if not run.named:
                run.run_id = run_name(args)
            run.policy_version = int(state.global_step)
            generations = int(getattr(args, "num_generations", 0) or 0)
            batch = int(getattr(args, "generation_batch_size", 0) or 0)
            if generations and batch:
                run.prompts_per_generation = max(1, batch // generations)
            if getattr(args, "shuffle_dataset", False):
                log.warning(
                    "GRPOConfig(shuffle_dataset=True): with CodeGymSpec.curriculum() TRL's shuffle buffer "
                    "draws 1,000 rows ahead of training; set shuffle_dataset=False"
                )

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            # Called before the step's first micro-batch, where GRPOTrainer generates: the rollouts
            # are played by the weights of `global_step` optimizer updates.
            run.policy_version = int(state.global_step)

    return CodeGymRunCallback()


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """The cyclic GC held off while a spec makes its long-lived objects (at CodeGym's size 80,130
    rows, 22,366 classes and 100,000 tool methods): its passes over them, all alive, cost as much
    CPU as making them. Not while GetEnv calls are in flight (the client's threads)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _common_prefix(ids: Iterable[str]) -> str:
    """The longest string every id starts with (what ListEnvs can be narrowed to)."""
    ordered = sorted(ids)
    if not ordered:
        return ""
    first, last = ordered[0], ordered[-1]
    size = 0
    while size < min(len(first), len(last)) and first[size] == last[size]:
        size += 1
    return first[:size]


def _tool_name(schema: ToolSchema) -> str:
    return str(schema.get("function", schema).get("name", ""))
