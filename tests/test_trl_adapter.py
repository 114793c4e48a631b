"""The TRL adapter (`codegym_client.trl`) against a real runtime and sandbox worker serving the sample
library, driven the way TRL's `GRPOTrainer` drives an `environment_factory` (trl/trainer/grpo_trainer.py):
a probe instance whose methods are listed with `inspect.getmembers` and rendered with
`transformers.utils.get_json_schema`, pooled instances reset with a dataset row, tools called with
keyword arguments inside `except Exception`, `get_reward()` read once per rollout. No torch."""

from __future__ import annotations

import gc
import inspect
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from transformers.utils import get_json_schema

from codegym.library.store import Library
from codegym_client import RuntimeClient, RuntimeUnavailable, SessionNotFound
from codegym_client.abilities import make_ability
from codegym_client.errors import EpisodeEnded, EpisodeFailed, InfrastructureFailure
from codegym_client.trl import CodeGymEnvironment, CodeGymSpec, environment_class
from codegym_jobs.oracle import read_trajectories
from tests.conftest import ENV_DIR, ROOT, SAMPLES
from tests.helpers.servers import CodegymServer

TRAJECTORIES = read_trajectories(SAMPLES / "trajectories.jsonl")


def ability(env_id: str, config: dict[str, Any]) -> str:
    return make_ability(env_id, config)


@pytest.fixture(scope="module")
def runtime(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    path = tmp_path_factory.mktemp("library") / "library.db"
    with Library(path) as lib:
        lib.import_paths([ENV_DIR, SAMPLES / "tasks.jsonl"])
    worker = CodegymServer(["serve", "sandbox", "--port", "0", "--jails", "1"])
    try:
        server = CodegymServer(
            ["serve", "runtime", "--port", "0", "--library", str(path), "--sandbox", worker.address]
        )
        try:
            yield server.address
        finally:
            assert server.stop() == 0
    finally:
        assert worker.stop() == 0


@pytest.fixture(scope="module")
def client(runtime: str) -> Iterator[RuntimeClient]:
    with RuntimeClient(runtime, timeout_s=30) as c:
        yield c


@pytest.fixture(scope="module")
def spec(runtime: str) -> CodeGymSpec:
    rows = [{"ability": ability(t["env_id"], t["config"])} for t in TRAJECTORIES]
    return CodeGymSpec(runtime, instances=rows)


def trl_tools(instance: object) -> dict[str, Any]:
    """The tools TRL takes from an instance (GRPOTrainer.__init__ and _generate_and_score_completions)."""
    return {
        name: member
        for name, member in inspect.getmembers(instance, predicate=inspect.ismethod)
        if name not in ("reset", "get_reward") and not name.startswith("_")
    }


def normalized(schema: dict[str, Any]) -> dict[str, Any]:
    """A tool definition with `required: []` spelled out (get_json_schema leaves an empty list out)."""
    function = dict(schema["function"])
    function["parameters"] = {"required": [], **function["parameters"]}
    return {"type": schema["type"], "function": function}


@pytest.mark.jail
def test_every_method_renders_as_its_tool_schema_for_every_sample_env(
    spec: CodeGymSpec, client: RuntimeClient
) -> None:
    env_ids = sorted({t["env_id"] for t in TRAJECTORIES})
    assert len(env_ids) == len(list(ENV_DIR.glob("*__*Env.py")))
    # Tool sets differ: one class per environment, keyed by env id, rows routed by `environment`.
    assert isinstance(spec.environment_factory, dict) and sorted(spec.environment_factory) == env_ids
    assert all(row["environment"] == row["env_id"] for row in spec.rows)
    assert spec.reward_funcs == []
    for env_id in env_ids:
        instance = spec.environment_factory[env_id]()
        expected = [json.loads(t.json_schema) for t in client.get_env(env_id).tools]
        tools = trl_tools(instance)
        assert sorted(tools) == sorted(s["function"]["name"] for s in expected), env_id
        for schema in expected:
            rendered = get_json_schema(tools[schema["function"]["name"]])
            assert normalized(rendered) == normalized(schema), (env_id, schema["function"]["name"])


@pytest.mark.jail
def test_the_probe_trl_makes_before_reset_opens_no_session(
    spec: CodeGymSpec, monkeypatch: pytest.MonkeyPatch
) -> None:
    opened: list[dict[str, Any]] = []
    create = RuntimeClient.create_session

    def counting(self: RuntimeClient, **kwargs: Any) -> Any:
        opened.append(kwargs)
        return create(self, **kwargs)

    monkeypatch.setattr(RuntimeClient, "create_session", counting)
    classes = spec.environment_factory
    assert isinstance(classes, dict)
    for factory in classes.values():
        instance = factory()  # what GRPOTrainer.__init__ does: build, list methods, render them
        for method in trl_tools(instance).values():
            get_json_schema(method)
        assert instance._session.session_id == ""
        with pytest.raises(EpisodeEnded):  # no episode before reset: a tool refuses and opens nothing
            next(iter(trl_tools(instance).values()))()
    assert opened == []


@pytest.mark.jail
def test_a_scripted_episode_through_the_adapter_reaches_reward_1(
    spec: CodeGymSpec, client: RuntimeClient
) -> None:
    trajectory = next(t for t in TRAJECTORIES if t["reward"] == 1.0 and len(t["steps"]) <= 40)
    classes = spec.environment_factory
    assert isinstance(classes, dict)
    env = classes[trajectory["env_id"]]()
    text = env.reset(prompt=[], ability=ability(trajectory["env_id"], trajectory["config"]), env_id="x")
    assert text.endswith(trajectory["first"])
    session_id = env._session.session_id
    tools = trl_tools(env)
    for action, observation in trajectory["steps"]:
        call = json.loads(action)
        assert tools[call["name"]](**call["parameters"]) == observation
    assert env.get_reward() == 1.0
    first = json.loads(trajectory["steps"][0][0])
    with pytest.raises(EpisodeEnded):  # after the episode: raises (TRL shows it to the model)
        tools[first["name"]](**first["parameters"])
    with pytest.raises(SessionNotFound):  # the step that ended the episode closed its session
        client.get_session(session_id)


@pytest.mark.jail
def test_ten_reuses_of_one_instance_leave_no_session_open(spec: CodeGymSpec, client: RuntimeClient) -> None:
    classes = spec.environment_factory
    assert isinstance(classes, dict)
    trajectory = TRAJECTORIES[0]
    env = classes[trajectory["env_id"]]()
    first = json.loads(trajectory["steps"][0][0])
    ids = []
    for _ in range(10):
        env.reset(ability=ability(trajectory["env_id"], trajectory["config"]))
        ids.append(env._session.session_id)
        getattr(env, first["name"])(**first["parameters"])  # mid-episode: the session stays open
        assert client.get_session(ids[-1]).step_index == 1
    assert len(set(ids)) == 10
    for session_id in ids[:-1]:  # each reset closed the previous session
        with pytest.raises(SessionNotFound):
            client.get_session(session_id)
    del env
    gc.collect()  # finalization closes the last one
    with pytest.raises(SessionNotFound):
        client.get_session(ids[-1])


@pytest.mark.jail
def test_interpreter_exit_closes_the_sessions_trl_left_open(runtime: str, client: RuntimeClient) -> None:
    trajectory = TRAJECTORIES[0]
    script = f"""
import json, sys
from codegym_client.trl import CodeGymSpec
spec = CodeGymSpec({runtime!r}, instances=[{{"ability": {ability(trajectory["env_id"], trajectory["config"])!r}}}])
pool = [spec.environment_factory() for _ in range(3)]  # TRL's pool: kept to the end, never closed
for env in pool:
    env.reset(**spec.rows[0])
print(json.dumps([env._session.session_id for env in pool]))
"""
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": f"{ROOT / 'clients'}"},
        check=True,
    )
    ids = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(ids) == 3 and all(ids)
    for session_id in ids:
        with pytest.raises(SessionNotFound):
            client.get_session(session_id)


@pytest.mark.jail
def test_an_unreachable_runtime_fails_the_episode_unscored_and_then_a_reset_ends_the_run(
    runtime: str,
) -> None:
    """With no wait (`outage_wait_s=0`): a step the runtime cannot serve fails the episode (the
    tool raises an `Exception`, which TRL shows to the model, and `get_reward()` is None, which TRL
    leaves unscored); a reset the runtime cannot serve ends the run (a `BaseException`)."""
    trajectory = TRAJECTORIES[0]
    row = {"ability": ability(trajectory["env_id"], trajectory["config"])}
    spec = CodeGymSpec(runtime, instances=[row], outage_wait_s=0)
    factory = spec.environment_factory
    assert isinstance(factory, type)
    env = factory()
    env.reset(**row)
    live = env._session.session_id
    dead = RuntimeClient("127.0.0.1:9", timeout_s=2, attempts=1)
    env._session.client = lambda: dead
    first = json.loads(trajectory["steps"][0][0])
    tool = getattr(env, first["name"])
    with pytest.raises(EpisodeFailed) as failed:
        tool(**first["parameters"])
    assert isinstance(failed.value, Exception)  # TRL's tool loop shows it as {"error": ...}
    assert isinstance(failed.value.__cause__, RuntimeUnavailable)
    assert env.get_reward() is None
    with pytest.raises(EpisodeFailed):  # the episode stays failed: nothing is sent
        tool(**first["parameters"])
    with pytest.raises(InfrastructureFailure):  # reset, with the runtime still unreachable
        try:
            env.reset(**row)
        except Exception:
            pytest.fail("a reset the runtime cannot serve was an ordinary Exception")
    dead.close()
    spec.client().close_session(live)  # the dead client could not close it


@pytest.mark.jail
def test_library_rows_and_one_class_when_the_tool_sets_agree(runtime: str, get_env_calls: list[str]) -> None:
    spec = CodeGymSpec(runtime, library="Sample_0006_", instruction="Use the tools.")
    assert get_env_calls == ["Sample_0006_I__ArrayGcdEnv"]  # once per environment: tasks and tools
    factory = spec.environment_factory
    assert isinstance(factory, type) and issubclass(factory, CodeGymEnvironment)
    assert factory.__name__ == "ArrayGcdEnv"
    assert {r["env_id"] for r in spec.rows} == {"Sample_0006_I__ArrayGcdEnv"}
    assert all("environment" not in r for r in spec.rows)
    assert spec.rows[0]["prompt"] == [{"role": "user", "content": "Use the tools.\n\n"}]
    dataset = spec.train_dataset
    assert len(dataset) == len(spec.rows) and "ability" in dataset[0] and "prompt" in dataset[0]
    with pytest.raises(ValueError):
        CodeGymSpec(runtime)


@pytest.mark.jail
def test_instances_from_a_jsonl_file(runtime: str, tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    rows = [{"ability": ability(t["env_id"], t["config"]), "answer": 1} for t in TRAJECTORIES[:3]]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = CodeGymSpec(runtime, instances=path)
    assert [r["ability"] for r in spec.rows] == [r["ability"] for r in rows]


class RecordingClient:
    """Stands in for RuntimeClient: records the actions a tool method sends."""

    def __init__(self) -> None:
        self.actions: list[dict[str, Any]] = []
        self.indexes: list[int | None] = []  # the step index each step was sent with

    def create_session(self, **kwargs: Any) -> Any:
        return SimpleNamespace(session_id="s1", task_text="Task.", observation="")

    def step(self, session_id: str, action: str, *, step_index: int | None = None) -> Any:
        self.actions.append(json.loads(action))
        self.indexes.append(step_index)
        index = len(self.actions)
        return SimpleNamespace(observation="ok", reward=0.0, done=False, truncated=False, step_index=index)

    def close_session(self, session_id: str) -> bool:
        return True


def test_optional_nested_and_union_parameters_render_and_send_as_written() -> None:
    schema = {
        "type": "function",
        "function": {
            "name": "Mark",
            "description": "Mark cells of the grid.",
            "parameters": {
                "type": "object",
                "properties": {
                    "cells": {
                        "type": "array",
                        "items": {"type": "array", "items": {"type": "integer"}},
                        "description": "Rows of cell ids.",
                    },
                    "label": {"type": ["integer", "string"], "description": "A label."},
                    "weight": {"type": "number", "description": "How much."},
                    "anything": {"description": "Any value."},
                    "flag": {"type": "boolean", "description": "Whether to keep."},
                },
                "required": ["cells", "label", "anything"],
            },
        },
    }
    fake = RecordingClient()
    cls = environment_class("GridEnv", [schema], lambda: fake)  # type: ignore[arg-type, return-value]
    env = cls()
    assert sorted(trl_tools(env)) == ["Mark"]
    assert normalized(get_json_schema(env.Mark)) == normalized(schema)
    assert env.reset(ability=make_ability("X_1__GridEnv", {})) == "Task."
    assert env.Mark(cells=[[1]], label="a", anything=None) == "ok"
    assert fake.actions == [{"name": "Mark", "parameters": {"cells": [[1]], "label": "a", "anything": None}}]
    assert env.Mark(cells=[], label=1, anything=1) == "ok"
    assert fake.indexes == [0, 1]  # each step with the session's index, from the replies
    with pytest.raises(ValueError):  # a tool TRL would not take as one
        environment_class("Bad", [{"function": {"name": "reset", "description": "x"}}], lambda: fake)  # type: ignore[arg-type, return-value]


@pytest.mark.jail
def test_without_datasets_the_dataset_is_a_list(runtime: str, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = CodeGymSpec(runtime, library=["Sample_0006_I__ArrayGcdEnv"])
    monkeypatch.setitem(sys.modules, "datasets", None)
    dataset = spec.train_dataset
    assert isinstance(dataset, list) and dataset == spec.rows
