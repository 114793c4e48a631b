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
environments of one spec share the wait (`codegym_client.outages.Outage`): an outage is counted
from the first call it failed, and once it has lasted `outage_wait_s` every further call is sent
once. Then:

- a step that fails (the outage outlasted the wait, the session was lost, e.g. by a runtime
  restarted with sessions in memory, a refused step) is never the model's doing (the step rule,
  `codegym_client.errors.STEP_FAULTS`), and ends
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

Modules: `tools` (a method per tool, from its JSON schema), `environment` (`CodeGymEnvironment`,
`environment_class`, `skip_failed_episodes`), `instances` (reading training-instance rows), `spec`
(`CodeGymSpec`) and `curriculum` (`Curriculum`, the run callback). Everything is imported from here.
"""

from __future__ import annotations

from codegym_client.abilities import ABILITY_PREFIX, ability_env_id
from codegym_client.trl.curriculum import Curriculum, run_name
from codegym_client.trl.environment import CodeGymEnvironment, environment_class, skip_failed_episodes
from codegym_client.trl.instances import PARQUET_BATCH_ROWS
from codegym_client.trl.spec import GETENV_CONCURRENCY, LIST_PAGE_SIZE, CodeGymSpec
from codegym_client.trl.tools import OMITTED, RESERVED, ToolSchema

__all__ = [
    "ABILITY_PREFIX",
    "GETENV_CONCURRENCY",
    "LIST_PAGE_SIZE",
    "OMITTED",
    "PARQUET_BATCH_ROWS",
    "RESERVED",
    "CodeGymEnvironment",
    "CodeGymSpec",
    "Curriculum",
    "ToolSchema",
    "ability_env_id",
    "environment_class",
    "run_name",
    "skip_failed_episodes",
]
