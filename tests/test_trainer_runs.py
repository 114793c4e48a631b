"""The trainer paths name their run, and the runtime's record of served episodes shows it: a recorded
oracle episode played through the TRL adapter (its callback carrying the run name and the global
step), verl's episode driver, `CodeGymTool`'s config and the OpenEnv gateway's reset, each under its
own run id, is counted in `Stats` for that run. And the curricula drawn from `SampleTasks`: TRL's
stream of rows (`Curriculum`) and verl's sampler (`CodeGymCurriculumSampler`, here on stand-ins of
torch's `Sampler` and verl's `RLHFDataset`; tests/test_verl_real.py builds it in verl).

Against a real runtime and sandbox worker serving the sample library, recording to SQLite beside it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
from openenv.core.generic_client import GenericEnvClient

from codegym.library.store import Library
from codegym_client import AsyncRuntimeClient, RuntimeClient
from codegym_client.trl import CodeGymSpec
from codegym_client.verl import run_episode
from codegym_testkit.trainer_script import TOKENIZER, ScriptedModel, ability, oracle_turns, trajectory
from tests.conftest import ENV_DIR, SAMPLES
from tests.helpers.openenv_play import rows
from tests.helpers.servers import CodegymServer, start_runtime, start_workers

pytestmark = pytest.mark.jail


@pytest.fixture(scope="module")
def runtime(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    path = tmp_path_factory.mktemp("library") / "library.db"
    with Library(path) as lib:
        lib.import_paths([ENV_DIR, SAMPLES / "tasks.jsonl"])
    workers = start_workers(count=1)
    try:
        server = start_runtime(path, workers)
        try:
            yield server.address
        finally:
            assert server.stop() == 0
    finally:
        for worker in workers:
            assert worker.stop() == 0


@pytest.fixture(scope="module")
def client(runtime: str) -> Iterator[RuntimeClient]:
    with RuntimeClient(runtime, timeout_s=30) as c:
        yield c


def played(client: RuntimeClient, run_id: str) -> dict[str, Any]:
    """The run's tasks with at least one recorded episode, by env id."""
    return {
        entry.task.env_id: entry.task
        for entry in client.stats(run_id, played_only=True)
        if entry.WhichOneof("entry") == "task" and entry.task.episodes >= 1
    }


def play_methods(instance: Any, recorded: dict[str, Any]) -> None:
    """A recorded oracle episode through a TRL environment's tool methods, as TRL calls them."""
    instance.reset(ability=ability(recorded))
    for action, _ in recorded["steps"]:
        call = json.loads(action)
        getattr(instance, call["name"])(**call["parameters"])
    assert instance.get_reward() == 1.0


def test_trl_episodes_are_recorded_under_the_trainers_run_name_and_global_step(client: RuntimeClient) -> None:
    recorded = trajectory("Sample_0006_I__ArrayGcdEnv")
    spec = CodeGymSpec(client.target, instances=[{"ability": ability(recorded)}], client=client)
    assert spec.run.run_id == "" and spec.run.policy_version is None
    callback: Any = spec.callback()  # duck-typed trainer arguments below
    from transformers import TrainerCallback

    assert TrainerCallback in type(callback).__mro__  # what GRPOTrainer(callbacks=[...]) takes
    args = SimpleNamespace(
        run_name="", output_dir="/runs/trl-grpo-7", num_generations=4, generation_batch_size=8
    )
    callback.on_train_begin(args, SimpleNamespace(global_step=0), None)
    assert (spec.run.run_id, spec.run.prompts_per_generation) == ("trl-grpo-7", 2)  # the output_dir's name
    callback.on_step_begin(args, SimpleNamespace(global_step=3), None)
    factory = spec.environment_factory
    assert isinstance(factory, type)
    play_methods(factory(), recorded)

    task = played(client, "trl-grpo-7")[recorded["env_id"]]
    assert (task.episodes, task.passes, task.last_policy_version) == (1, 1, 3)

    named = CodeGymSpec(
        client.target, instances=[{"ability": ability(recorded)}], client=client, run_id="mine"
    )
    named_callback: Any = named.callback()
    named_callback.on_train_begin(
        SimpleNamespace(run_name="theirs", output_dir="x"), SimpleNamespace(global_step=0), None
    )
    assert named.run.run_id == "mine"  # a run id given to the spec stays


async def test_verl_episodes_are_recorded_under_the_run_id(runtime: str, client: RuntimeClient) -> None:
    recorded = trajectory("Sample_0001_I__MaxSubarraySumEnv", 27)
    async with AsyncRuntimeClient(runtime, timeout_s=30) as aclient:
        episode = await run_episode(
            aclient,
            ability(recorded),
            tokenizer=TOKENIZER,  # type: ignore[arg-type]  # a byte-level stand-in
            generate=ScriptedModel(oracle_turns(recorded)),
            run_id="verl-exp-1",
            policy_version=5,
        )
    assert episode.reward == 1.0
    task = played(client, "verl-exp-1")[recorded["env_id"]]
    assert (task.episodes, task.passes, task.last_policy_version) == (1, 1, 5)


async def test_the_openenv_gateway_records_under_the_resets_run_id(
    runtime: str, client: RuntimeClient
) -> None:
    gateway = CodegymServer(["serve", "openenv", "--runtime", runtime, "--port", "0"])
    refused = ""
    try:
        ((row, steps),) = rows(1)
        async with GenericEnvClient(base_url=f"http://{gateway.address}") as env:
            await env.reset(ability=row["ability"], run_id="openenv-run", policy_version=2)
            for action, expected in steps:
                result = await env.step(
                    {"type": "call_tool", "tool_name": action["name"], "arguments": action["parameters"]}
                )
                assert result.observation["result"] == expected
            assert result.done and result.reward == 1.0
            try:
                await env.reset(ability=row["ability"], run_id=7)
            except Exception as exc:  # OpenEnv's client raises the gateway's error frame
                refused = str(exc)
    finally:
        gateway.stop()
    assert "run_id is a string" in refused, refused
    task = played(client, "openenv-run")[row["ability"].split("@")[1]]
    assert (task.episodes, task.passes, task.last_policy_version) == (1, 1, 2)


def test_trls_curriculum_draws_rows_of_the_specs_shape_from_sample_tasks(client: RuntimeClient) -> None:
    spec = CodeGymSpec(client.target, library="Sample_", client=client, run_id="trl-curriculum")
    first = spec.curriculum_source(prompts_per_draw=4, seed=11)
    rows_a = [first.draw(), first.draw()]
    rows_b = [spec.curriculum_source(prompts_per_draw=4, seed=11).draw() for _ in range(1)]
    assert rows_a[0] == rows_b[0]  # the same seed and record: the same rows
    for row in rows_a[0] + rows_a[1]:
        assert len(rows_a[0]) == 4
        assert set(row) == set(spec.rows[0]) and row["environment"] == row["env_id"]
        assert row["env_id"] in spec.environment_classes
    # A stream of such rows is what GRPOTrainer gets (an IterableDataset where `datasets` is).
    stream = spec.curriculum_source(prompts_per_draw=3, seed=0).rows()
    assert [next(stream)["ability"] for _ in range(7)]


# -- verl's sampler on stand-ins of torch's Sampler and verl's RLHFDataset ---------------------------


@pytest.fixture
def sampler_module(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    torch = ModuleType("torch")
    torch_utils = ModuleType("torch.utils")
    torch_data = ModuleType("torch.utils.data")

    class Sampler:  # torch's: a base with no state
        pass

    torch_data.Sampler = Sampler  # type: ignore[attr-defined]
    torch_data.get_worker_info = lambda: None  # type: ignore[attr-defined]
    rl_dataset = ModuleType("verl.utils.dataset.rl_dataset")

    class RLHFDataset:  # verl's: rows in `dataframe`
        def __init__(self, data_files: Any, tokenizer: Any, config: Any, **_: Any) -> None:
            self.dataframe = list(data_files)

        def __len__(self) -> int:
            return len(self.dataframe)

        def __getitem__(self, item: int) -> Any:
            return self.dataframe[item]

    rl_dataset.RLHFDataset = RLHFDataset  # type: ignore[attr-defined]
    modules = {"torch": torch, "torch.utils": torch_utils, "torch.utils.data": torch_data}
    for name in ("verl", "verl.utils", "verl.utils.dataset"):
        modules[name] = ModuleType(name)
    modules["verl.utils.dataset.rl_dataset"] = rl_dataset
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    sys.modules.pop("codegym_client.verl.sampler", None)
    import codegym_client.verl.sampler as sampler

    try:
        yield sampler
    finally:
        sys.modules.pop("codegym_client.verl.sampler", None)


def sample_rows() -> list[dict[str, Any]]:
    """The sample library's tasks as `codegym export` rows (configs spelled with spaces, as published)."""
    tasks = [json.loads(line) for line in (SAMPLES / "tasks.jsonl").read_text().splitlines() if line.strip()]
    return [
        {
            "ability": f"codegym_v1@{t['env_id']}@{json.dumps(t['config'], indent=1)}",
            "extra_info": {"index": str(i)},
        }
        for i, t in enumerate(tasks)
    ]


def test_verls_sampler_yields_the_runtimes_choice_as_dataset_indices(
    sampler_module: Any, runtime: str, client: RuntimeClient, caplog: pytest.LogCaptureFixture
) -> None:
    data = sample_rows()
    config = {"train_batch_size": 4, "codegym": {"target": runtime, "run_id": "verl-curriculum", "seed": 3}}
    sampler = sampler_module.CodeGymCurriculumSampler(data, config)
    assert len(sampler) == len(data)
    indices = list(sampler)
    assert len(indices) == len(data) and all(0 <= i < len(data) for i in indices)
    # Each batch is the runtime's choice for the run, seeded seed + k, mapped to the rows by task.
    chosen = client.sample_tasks("verl-curriculum", 4, seed=3)
    keys = {sampler_module.task_key(t.ability) for t in chosen.tasks}
    assert {sampler_module.task_key(data[i]["ability"]) for i in indices[:4]} <= keys
    again = sampler_module.CodeGymCurriculumSampler(data, config)
    assert list(again) == indices  # deterministic given the seed and the record
    sampler.update(None)  # a no-op: the runtime recorded the episodes itself

    # Rows the runtime does not have: every task skipped, uniform indices with a warning.
    strange = [{"ability": "codegym_v1@Nope__NoEnv@{}"} for _ in range(8)]
    fallback = sampler_module.CodeGymCurriculumSampler(strange, config)
    assert set(fallback) <= set(range(8))
    assert "4 of its own rows, uniformly" in caplog.text

    # verl 0.9's way in: the training set's rows follow the sampler, the validation set's do not.
    dataset_config = {**config, "train_files": data}
    train = sampler_module.CodeGymCurriculumDataset(data, None, dataset_config)
    assert [train[0], train[0], train[0], train[0]] == [data[i] for i in indices[:4]]
    val = sampler_module.CodeGymCurriculumDataset(data[:2], None, dataset_config)
    assert (val.curriculum, val[1]) == (None, data[1])
