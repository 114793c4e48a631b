"""`CodeGymSpec`: what `GRPOTrainer` takes to train on CodeGym environments served by a runtime
(the dataset rows, the environment classes, the reward functions), built from training-instance
rows or from the runtime's own library. See the package docstring (codegym_client/trl/__init__.py)."""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from codegym_client.abilities import ability_env_id, make_ability
from codegym_client.outages import DEFAULT_OUTAGE_WAIT_S, Outage
from codegym_client.requests import DEFAULT_TARGET
from codegym_client.runtime_client import RuntimeClient
from codegym_client.trl.curriculum import (
    CURRICULA,
    Curriculum,
    common_prefix,
    curriculum_rows,
    run_callback,
)
from codegym_client.trl.environment import CodeGymEnvironment, Run, class_name, environment_class
from codegym_client.trl.instances import optional_module, read_instances
from codegym_client.trl.tools import ToolSchema, tool_name

log = logging.getLogger(__name__)
T = TypeVar("T")

# GetEnv calls a spec keeps in flight while it builds (`CodeGymSpec(getenv_concurrency=...)`), and
# the ListEnvs page it asks for (the runtime's largest).
GETENV_CONCURRENCY = 8
LIST_PAGE_SIZE = 1000


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
        self._outage = Outage(outage_wait_s)  # one wait for all of the spec's environments
        self.run = Run(run_id)  # the run and policy version its sessions are created for
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
                name = class_name(env_ids[0]) if len(env_ids) == 1 else "CodeGymEnv"
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
                    name = class_name(env_id)
                    if name in names:  # TRL names a reward column after the class: keep them apart
                        name = class_name(env_id.replace("__", "_"))
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
        datasets = optional_module("datasets")
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
        return run_callback(self.run)

    def curriculum(self, *, prompts_per_draw: int = 0, seed: int = 0, **options: Any) -> Any:
        """A `datasets.IterableDataset` of rows (`train_dataset`'s shape) drawn from the runtime's
        record for the spec's run (`SampleTasks`), one draw at a time: give it to `GRPOTrainer` as
        `train_dataset`, with `callbacks=[spec.callback()]` and `GRPOConfig(max_steps=...,
        shuffle_dataset=False)`. See `Curriculum`."""
        datasets = optional_module("datasets")
        if datasets is None:
            raise ValueError("the curriculum dataset needs `datasets` (TRL brings it)")
        source = self.curriculum_source(prompts_per_draw=prompts_per_draw, seed=seed, **options)
        key = len(CURRICULA)
        CURRICULA[key] = source
        return datasets.IterableDataset.from_generator(curriculum_rows, gen_kwargs={"key": key})

    def curriculum_source(self, *, prompts_per_draw: int = 0, seed: int = 0, **options: Any) -> Curriculum:
        """The `Curriculum` behind `curriculum()`: its draws as lists of rows, without `datasets`."""
        return Curriculum(
            run=self.run,
            client=self.client,
            outage=self._outage,
            env_ids=self.environment_classes,
            row=self.row,
            fallback_rows=self.rows,
            prompts_per_draw=prompts_per_draw,
            seed=seed,
            **options,
        )

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
        for row in read_instances(instances):
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
            names = self._tool_names(common_prefix(given))
            for env_id, tools in given.items():
                listed = names.get(env_id)
                if listed is not None and listed == [tool_name(t) for t in tools]:
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
            lambda: client.list_envs(prefix=prefix, page_size=LIST_PAGE_SIZE), "CodeGym ListEnvs"
        )
        return {e.env_id: list(e.tool_names) for e in listed}

    def _library_rows(self, library: bool | str | Sequence[str] | None) -> list[str]:
        client = self.client()
        if isinstance(library, str) or library is True:
            prefix = "" if library is True else str(library)
            listed = self._outage.call(
                lambda: client.list_envs(prefix=prefix, page_size=LIST_PAGE_SIZE), "CodeGym ListEnvs"
            )
            env_ids = [e.env_id for e in listed if e.task_count]  # an env without tasks gives no row
        else:
            env_ids = list(library or [])

        def abilities(env: Any) -> list[str]:
            return [make_ability(env.env_id, task.config_json) for task in env.tasks]

        return [ability for each in self._each_env(env_ids, abilities) for ability in each]


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
