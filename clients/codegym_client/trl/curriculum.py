"""The runtime's curriculum for a TRL run (`Curriculum`, `CodeGymSpec.curriculum()`), and the
`TrainerCallback` that names the spec's sessions after the trainer's run and step
(`CodeGymSpec.callback()`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from codegym_client.curriculum import uniform_fallback
from codegym_client.outages import Outage
from codegym_client.runtime_client import RuntimeClient
from codegym_client.trl.environment import Run
from codegym_client.trl.instances import optional_module

log = logging.getLogger(__name__)


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
        self,
        *,
        run: Run,
        client: Callable[[], RuntimeClient],
        outage: Outage,
        env_ids: Collection[str],
        row: Callable[[str], dict[str, Any]],
        fallback_rows: Sequence[Mapping[str, Any]],
        prompts_per_draw: int = 0,
        seed: int = 0,
        **options: Any,
    ) -> None:
        """`run`, `client` and `outage` are the spec's; `env_ids` its environments, `row` how it
        makes a task's row, and `fallback_rows` its own rows, for a draw left empty."""
        self.run = run
        self.client = client
        self.outage = outage
        self.env_ids = env_ids
        self.row = row
        self.fallback_rows = fallback_rows
        self.prompts_per_draw = int(prompts_per_draw)
        self.seed = int(seed)
        self.options = {"env_prefix": common_prefix(env_ids), **options}
        self.draws = 0  # draws taken: the next one is seeded seed + draws

    def rows(self) -> Iterator[dict[str, Any]]:
        """Rows, forever, one draw at a time (each asked for when the previous one is used up)."""
        while True:
            yield from self.draw()

    def draw(self) -> list[dict[str, Any]]:
        """The next draw's rows."""
        run = self.run
        size = self.prompts_per_draw or run.prompts_per_generation or self.DEFAULT_DRAW
        seed = self.seed + self.draws
        self.draws += 1
        client = self.client()
        response = self.outage.call(
            lambda: client.sample_tasks(run.run_id, size, seed=seed, **self.options),
            f"CodeGym SampleTasks for run {run.run_id!r}",
        )
        rows = [self.row(task.ability) for task in response.tasks if task.env_id in self.env_ids]
        if len(rows) < len(response.tasks):
            log.warning(
                "CodeGym curriculum: %d of %d sampled tasks are of environments the spec does not have: skipped",
                len(response.tasks) - len(rows),
                len(response.tasks),
            )
        if not rows:
            rows = [dict(row) for row in uniform_fallback(self.fallback_rows, size, seed, run.run_id, log)]
        return rows


# The curricula `CodeGymSpec.curriculum()` made, by key: `datasets` pickles a generator and its
# arguments to fingerprint the dataset, and a curriculum holds the spec's gRPC channel, which does
# not pickle; the generator is a module function and its argument a number.
CURRICULA: dict[int, Curriculum] = {}


def curriculum_rows(key: int) -> Iterator[dict[str, Any]]:
    yield from CURRICULA[key].rows()


def run_name(args: Any) -> str:
    """The run id of a `transformers.TrainingArguments` (GRPOConfig): its `run_name`, else the name
    of its `output_dir` (what a trainer names its run by: the checkpoints' folder)."""
    name = str(getattr(args, "run_name", None) or "")
    if name:
        return name
    return Path(str(getattr(args, "output_dir", None) or "trainer_output")).name


def run_callback(run: Run) -> Any:
    """`CodeGymSpec.callback()`: a `transformers.TrainerCallback` keeping `run` up to date."""
    transformers = optional_module("transformers")
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


def common_prefix(ids: Iterable[str]) -> str:
    """The longest string every id starts with (what ListEnvs can be narrowed to)."""
    ordered = sorted(ids)
    if not ordered:
        return ""
    first, last = ordered[0], ordered[-1]
    size = 0
    while size < min(len(first), len(last)) and first[size] == last[size]:
        size += 1
    return first[:size]
