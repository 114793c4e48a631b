"""A curriculum for verl from the runtime's record of served episodes. Imports torch (verl's).

`CodeGymCurriculumSampler` yields dataset indices a batch at a time, each batch the tasks the runtime
chooses for the run (`SampleTasks`: the run's learnable band, a share of tasks it has not seen, none
it has mastered or that fail for everyone, a cap per environment), mapped to the dataset's rows by
their `ability`.

How it plugs in, checked against verl's code:

- verl up to 0.8 (and its main branch until `data.sampler` was dropped): `data.sampler.class_path`
  names a module and `data.sampler.class_name` the class; `create_rl_sampler` builds it as
  `cls(data_source=dataset, data_config=config.data)`, asserts an `AbstractSampler`, requires
  `data.dataloader_num_workers=0`, and `RayPPOTrainer.fit` calls `update(batch=batch)` after each
  step when it is an `AbstractCurriculumSampler` (verl/experimental/dataset/sampler.py). The class
  subclasses that interface when verl has it.
- verl 0.9.1 has neither the interface nor the config key: `create_rl_sampler`
  (verl/trainer/ppo/utils.py) builds a random or sequential sampler and nothing else, in the v1
  trainer (`_init_dataloader`) and in the legacy one. What 0.9.1 still loads from the config is a
  dataset class (`data.custom_cls.path` / `name`, `get_dataset_class`), so `CodeGymCurriculumDataset`
  is an `RLHFDataset` that serves, for each row verl's sampler asks for, the next row of this
  sampler instead (verl repeats each row `rollout.n` times after the dataloader, so a group plays
  one task). `RayPPOTrainer(train_sampler=CodeGymCurriculumSampler(...))` takes the sampler too, for
  a task runner of your own.

Configuration, under `data.codegym` (add it with `+data.codegym.target=HOST:PORT`): `target`,
`run_id` (default: `trainer.experiment_name`, the name the agent loop records episodes under),
`seed` (default `data.seed`, else 0), `timeout_s`, `outage_wait_s`, and `sample_tasks`' options
`low`, `high`, `explore`, `per_env_cap`, `min_episodes`, `env_prefix`. A batch is
`data.gen_batch_size` or `data.train_batch_size` indices; the k-th batch is drawn with seed
`seed + k`, so the same seed and record give the same indices. Abilities the dataset lacks are
skipped (compared by env id and config, however the config's JSON is spelled); a batch with none
the dataset has is drawn uniformly from the dataset (seeded), with a warning.

`update(batch)` does nothing: the runtime records each episode's outcome itself when its session
ends (the agent loop names the run), across every rollout worker and trainer process, so the next
batch's choice already reflects this one; the trainer's batch adds nothing the record lacks.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterator, Mapping, Sequence, Sized
from typing import Any

from codegym_client.abilities import ability_parts
from codegym_client.curriculum import uniform_fallback
from codegym_client.outages import DEFAULT_OUTAGE_WAIT_S, ride_out
from codegym_client.requests import DEFAULT_TARGET
from codegym_client.runtime_client import RuntimeClient

try:  # verl <= 0.8: the interface `data.sampler.class_path` builds
    from verl.experimental.dataset.sampler import AbstractCurriculumSampler as _SamplerBase
except ImportError:  # verl 0.9 dropped it: a plain torch sampler (torch is verl's)
    from torch.utils.data import Sampler as _SamplerBase

__all__ = ["CodeGymCurriculumDataset", "CodeGymCurriculumSampler", "task_key"]

log = logging.getLogger(__name__)

OPTIONS = ("low", "high", "explore", "per_env_cap", "min_episodes", "env_prefix")


def task_key(ability: str) -> tuple[str, str]:
    """A task however its config's JSON is spelled: env id and the config with sorted keys (an
    ability as `codegym export` writes it holds the config as published; the runtime's record holds
    it as the library does)."""
    _, env_id, config = ability_parts(ability)
    try:
        return env_id, json.dumps(json.loads(config), sort_keys=True)
    except ValueError:
        return env_id, config


def _get(config: Any, key: str, default: Any = None) -> Any:
    if config is None:
        return default
    value = config.get(key) if hasattr(config, "get") else getattr(config, key, None)
    return default if value is None else value


def _root_experiment_name(data_config: Any) -> str:
    """`trainer.experiment_name` of the whole config `data_config` belongs to (an OmegaConf node
    keeps its root), or ""."""
    root = getattr(data_config, "_get_root", None)
    if root is None:
        return ""
    try:
        trainer = _get(root(), "trainer")
        return str(_get(trainer, "experiment_name", "") or "")
    except Exception:  # a detached node, or a config without `trainer`
        return ""


def dataset_abilities(data_source: Any) -> list[str]:
    """The `ability` of each row of the dataset: verl's `RLHFDataset` holds its rows in `dataframe`
    (a `datasets.Dataset`: the column is read at once, no row is tokenized); otherwise the rows
    themselves (`ability`, else `extra_info.ability`)."""
    frame = getattr(data_source, "dataframe", None)
    if frame is not None and "ability" in getattr(frame, "column_names", ()):
        return [str(a or "") for a in frame["ability"]]
    rows: Any = frame if frame is not None else data_source
    out = []
    for i in range(len(rows)):
        row = rows[i]
        ability = row.get("ability") if isinstance(row, Mapping) else None
        if not ability and isinstance(row, Mapping) and isinstance(row.get("extra_info"), Mapping):
            ability = row["extra_info"].get("ability")
        out.append(str(ability or ""))
    return out


class CodeGymCurriculumSampler(_SamplerBase):
    """Dataset indices, a batch at a time, from the runtime's `SampleTasks` (module docstring)."""

    def __init__(self, data_source: Sized, data_config: Any, client: RuntimeClient | None = None) -> None:
        self.data_source = data_source
        codegym = _get(data_config, "codegym") or {}
        self.target = str(_get(codegym, "target", DEFAULT_TARGET))
        self.run_id = str(_get(codegym, "run_id", "") or _root_experiment_name(data_config))
        self.seed = int(_get(codegym, "seed", _get(data_config, "seed", 0)))
        self.batch_size = int(_get(data_config, "gen_batch_size") or _get(data_config, "train_batch_size", 1))
        self.outage_wait_s = float(_get(codegym, "outage_wait_s", DEFAULT_OUTAGE_WAIT_S))
        self.options = {key: _get(codegym, key) for key in OPTIONS if _get(codegym, key) is not None}
        self._timeout_s = float(_get(codegym, "timeout_s", 60.0))
        self._client = client
        self.indices: dict[tuple[str, str], list[int]] = {}
        for index, ability in enumerate(dataset_abilities(data_source)):
            if ability:
                self.indices.setdefault(task_key(ability), []).append(index)
        self.batches = 0  # batches drawn: the next one is seeded seed + batches

    def client(self) -> RuntimeClient:
        if self._client is None:
            self._client = RuntimeClient(self.target, timeout_s=self._timeout_s)
        return self._client

    def __len__(self) -> int:
        """The dataset's size: verl counts an epoch's steps from it (`len(train_dataloader)`)."""
        return len(self.data_source)

    def __iter__(self) -> Iterator[int]:
        """One epoch: `len(self)` indices (whole batches), each batch drawn when the last is used."""
        left = len(self)
        while left > 0:
            batch = self.draw()
            yield from batch[:left]
            left -= len(batch)

    def draw(self) -> list[int]:
        """The next batch's dataset indices (`batch_size` of them, seeded `seed + batches`)."""
        seed = self.seed + self.batches
        self.batches += 1
        client = self.client()
        response = ride_out(
            lambda: client.sample_tasks(self.run_id, self.batch_size, seed=seed, **self.options),
            f"CodeGym SampleTasks for run {self.run_id!r}",
            self.outage_wait_s,
        )
        rng = random.Random(seed)
        chosen = [
            rng.choice(rows)
            for rows in (self.indices.get(task_key(t.ability)) for t in response.tasks)
            if rows
        ]
        if len(chosen) < len(response.tasks):
            log.warning(
                "CodeGym curriculum: %d of %d sampled tasks are not in the dataset: skipped",
                len(response.tasks) - len(chosen),
                len(response.tasks),
            )
        if not chosen:
            return uniform_fallback(range(len(self)), self.batch_size, seed, self.run_id, log)
        drawn = len(chosen)  # fewer tasks than a batch (a small library): the choice again, in turn
        chosen += [chosen[i % drawn] for i in range(self.batch_size - drawn)]
        return chosen

    def update(self, batch: Any) -> None:
        """Nothing: the runtime has recorded the batch's episodes already (module docstring)."""


def _dataset_base() -> type:
    from verl.utils.dataset.rl_dataset import RLHFDataset

    return RLHFDataset


class CodeGymCurriculumDataset(_dataset_base()):  # type: ignore[misc]
    """verl 0.9's way in (`data.custom_cls`): an `RLHFDataset` whose training rows follow
    `CodeGymCurriculumSampler` whatever index verl's own sampler asks for. The validation set
    (built with the same class, from `data.val_files`) is served as it is."""

    def __init__(
        self, data_files: str | Sequence[str], tokenizer: Any, config: Any, *args: Any, **kwargs: Any
    ):
        super().__init__(data_files, tokenizer, config, *args, **kwargs)
        train_files = _get(config, "train_files")
        train = (
            list(train_files)
            if isinstance(train_files, Sequence) and not isinstance(train_files, str)
            else [train_files]
        )
        given = list(data_files) if not isinstance(data_files, str) else [data_files]
        self.curriculum: CodeGymCurriculumSampler | None = None
        self._next: Iterator[int] | None = None
        if [str(f) for f in given] == [str(f) for f in train]:
            self.curriculum = CodeGymCurriculumSampler(self, config)

    def __getitem__(self, item: int) -> Any:
        if self.curriculum is None:
            return super().__getitem__(item)
        from torch.utils.data import get_worker_info

        if get_worker_info() is not None:
            raise RuntimeError(
                "CodeGymCurriculumDataset needs data.dataloader_num_workers=0 (one draw at a time)"
            )
        if self._next is None:
            self._next = self._indices()
        return super().__getitem__(next(self._next))

    def _indices(self) -> Iterator[int]:
        assert self.curriculum is not None
        while True:
            yield from self.curriculum.draw()
