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
  `{"error": ...}` tool message the model sees. An infrastructure fault must not become one, so a
  tool raises `InfrastructureFailure`, a `BaseException` (as `KeyboardInterrupt` is), which stops
  the step instead. A tool called after the episode ended raises `EpisodeEnded` (an ordinary
  error: the model's doing, shown to it).
- An environment that defines `get_reward()` owns its reward: TRL adds a reward column calling it
  once per rollout. So `CodeGymSpec.reward_funcs` is an empty list (extend it with shaping rewards
  of your own); passing a reward function of the final reward too would count it twice.
- With a dict factory, rows carry `environment` and only that environment's tools are shown:
  `environment_factory` is a dict keyed by env id when the dataset's environments have different
  tool sets, and one class otherwise.

Sessions: a session ends when its episode ends (the step that ends it closes it), on the next
`reset`, when the instance is collected (`weakref.finalize`) and at interpreter exit (the same
finalizer, run by `atexit`), so a run leaves none open in the runtime.

Needs nothing beyond the client: `datasets`, when importable, makes `train_dataset` a
`datasets.Dataset` (else a list of dicts); `transformers` is only TRL's.
"""

from __future__ import annotations

import importlib
import inspect
import json
import keyword
import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from codegym_client.errors import CodeGymError, EpisodeEnded, InfrastructureFailure
from codegym_client.requests import DEFAULT_TARGET
from codegym_client.runtime_client import RuntimeClient

__all__ = [
    "ABILITY_PREFIX",
    "CodeGymEnvironment",
    "CodeGymSpec",
    "EpisodeEnded",
    "InfrastructureFailure",
    "ToolSchema",
    "environment_class",
]

log = logging.getLogger(__name__)

ABILITY_PREFIX = "codegym_v1"
RESERVED = frozenset({"reset", "get_reward"})  # the names TRL does not take as tools

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


class _Session:
    """The session an instance holds, closable without the instance (its finalizer holds this)."""

    def __init__(self, client: Callable[[], RuntimeClient]) -> None:
        self.client = client
        self.session_id = ""
        self.lock = threading.Lock()

    def close(self) -> None:
        with self.lock:
            session_id, self.session_id = self.session_id, ""
        if not session_id:
            return
        try:
            self.client().close_session(session_id)
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

    def __init__(self) -> None:
        # Opens nothing: TRL builds one instance just to read its tools.
        self._session = _Session(type(self)._client_factory)
        self._finalizer = weakref.finalize(self, self._session.close)  # also runs at exit (atexit)
        self._done = False
        self._reward = 0.0
        self._failure: BaseException | None = None

    def reset(self, **row: Any) -> str:
        """Start an episode on the row's `ability`; returns the task text and the first observation."""
        self._session.close()
        self._done, self._reward, self._failure = False, 0.0, None
        ability = row.get("ability")
        if not isinstance(ability, str):
            raise ValueError("the row has no 'ability' (codegym_v1@{code_id}__{Env}@{config})")
        env_id = ability_env_id(ability)
        if self.env_ids and env_id not in self.env_ids:
            raise ValueError(f"{type(self).__name__} plays {sorted(self.env_ids)}, not {env_id}")
        try:
            created = self._session.client().create_session(ability=ability, max_steps=self._max_steps)
        except CodeGymError as exc:
            if exc.infrastructure:
                raise InfrastructureFailure(f"CreateSession failed: {exc.reason or exc}") from exc
            raise  # EnvNotFound, EnvFailed, InvalidRequest: the data is wrong, the same call fails again
        with self._session.lock:
            self._session.session_id = created.session_id
        text = created.task_text
        return f"{text}\n\n{created.observation}" if created.observation else text

    def get_reward(self) -> float:
        """The episode's reward (the final one once it ended: 1.0 for a right answer)."""
        if self._failure is not None:
            raise InfrastructureFailure("the episode failed in the runtime") from self._failure
        return self._reward

    def _call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        if self._failure is not None:
            raise InfrastructureFailure("the episode failed in the runtime") from self._failure
        session_id = self._session.session_id
        if self._done:
            raise EpisodeEnded(f"the episode has ended: {name} was not run")
        if not session_id:
            raise EpisodeEnded("no episode: reset() first")
        action = {"name": name, "parameters": arguments}
        try:
            response = self._session.client().step(session_id, json.dumps(action, ensure_ascii=False))
        except CodeGymError as exc:
            self._failure = exc
            self._session.close()
            raise InfrastructureFailure(f"Step failed in the runtime: {exc.reason or exc}") from exc
        self._reward = float(response.reward)
        if response.done or response.truncated:
            self._done = True
            self._session.close()
        return str(response.observation)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} session={self._session.session_id or None}>"


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
) -> type[CodeGymEnvironment]:
    """A `CodeGymEnvironment` subclass with one method per tool of `tool_schemas`."""
    namespace: dict[str, Any] = {
        "env_ids": frozenset(env_ids),
        "tool_schemas": tuple(tool_schemas),
        "_client_factory": staticmethod(client_factory),
        "_max_steps": max_steps,
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


def _read_instances(instances: str | Path | Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(instances, str | Path):
        path = Path(instances)
        if path.suffix == ".parquet":  # `codegym export --out X.parquet`: read with `datasets` (TRL has it)
            datasets = _optional("datasets")
            if datasets is None:
                raise ValueError(f"{path}: reading Parquet needs `datasets`; or export JSONL")
            return [dict(r) for r in datasets.Dataset.from_parquet(str(path))]
        lines = path.read_text(encoding="utf-8").splitlines()
        return [json.loads(line) for line in lines if line.strip()]
    return [dict(r) for r in instances]


class CodeGymSpec:
    """What `GRPOTrainer` takes to train on CodeGym environments served by a runtime at `target`.

    Tasks come from `instances` (training-instance rows with an `ability`, a JSONL/Parquet path or
    the rows themselves, e.g. `codegym export`'s file) or from the runtime's own `library` (its task
    configs: `True` for every environment, an env-id prefix, or a list of env ids). Tool schemas come
    from the runtime (`GetEnv`): building a spec opens no session.

    - `train_dataset`: one row per task, `prompt` (a user message holding `instruction`; TRL appends
      what `reset` returns: the task and the first observation), `ability`, `env_id`, and
      `environment` when `environment_factory` is a dict. A `datasets.Dataset` when `datasets` is
      importable, else a list of dicts.
    - `environment_factory`: a class (one set of tools) or a dict {env id: class}; call it for an
      instance. `environment_classes` maps every env id to its class.
    - `reward_funcs`: `[]`: the environments own their reward (`get_reward`), which TRL adds itself.
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
    ) -> None:
        if (instances is None) == (library is None or library is False):
            raise ValueError("give exactly one of instances= and library=")
        self.target = target
        self._client = client
        self._client_lock = threading.Lock()
        self._timeout_s = timeout_s
        rows = _read_instances(instances) if instances is not None else self._library_rows(library)
        if not rows:
            raise ValueError("no tasks: the instances or the library selection is empty")
        env_ids = list(dict.fromkeys(ability_env_id(str(r.get("ability", ""))) for r in rows))
        schemas = {env_id: self._tool_schemas(env_id) for env_id in env_ids}
        tool_sets = {json.dumps(s, sort_keys=True) for s in schemas.values()}
        self.environment_classes: dict[str, type[CodeGymEnvironment]] = {}
        self.environment_factory: type[CodeGymEnvironment] | dict[str, type[CodeGymEnvironment]]
        if len(tool_sets) == 1:  # one set of tools: one class plays every row
            name = _class_name(env_ids[0]) if len(env_ids) == 1 else "CodeGymEnv"
            shared = environment_class(
                name, schemas[env_ids[0]], self.client, env_ids=env_ids, max_steps=max_steps
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
                    name, schemas[env_id], self.client, env_ids=[env_id], max_steps=max_steps
                )
            self.environment_factory = dict(self.environment_classes)
        multi = isinstance(self.environment_factory, dict)
        content = f"{instruction}\n\n" if instruction else ""
        self.rows: list[dict[str, Any]] = []
        for row in rows:
            ability = str(row["ability"])
            env_id = ability_env_id(ability)
            out: dict[str, Any] = {"prompt": [{"role": "user", "content": content}], "ability": ability}
            out["env_id"] = env_id
            if multi:
                out["environment"] = env_id
            self.rows.append(out)
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

    def _tool_schemas(self, env_id: str) -> list[ToolSchema]:
        env = self.client().get_env(env_id)
        return [json.loads(t.json_schema) for t in env.tools]

    def _library_rows(self, library: bool | str | Sequence[str] | None) -> list[dict[str, Any]]:
        client = self.client()
        if isinstance(library, str) or library is True:
            prefix = "" if library is True else str(library)
            env_ids = [e.env_id for e in client.list_envs(prefix=prefix)]
        else:
            env_ids = list(library or [])
        rows = []
        for env_id in env_ids:
            for task in client.get_env(env_id).tasks:
                rows.append({"ability": f"{ABILITY_PREFIX}@{env_id}@{task.config_json}"})
        return rows
