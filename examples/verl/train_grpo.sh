#!/usr/bin/env bash
# GRPO on CodeGym environments with verl's agent loop (verl >= 0.8, vLLM or SGLang in async mode).
# Before: a runtime serving the library (`codegym up --library run1/library.db`) and the training set:
#   .venv/bin/codegym export --library run1/library.db --tools json --split 0.1 --out data/codegym.parquet
# (--tools json: the prompt holds the task and the native-calling protocol; the tools reach the chat
# template from the session, so the prompt does not list them twice.) Then, on the GPU machine with verl:
#   pip install '/path/to/checkout/clients[verl]'
#   bash examples/verl/train_grpo.sh trainer.n_gpus_per_node=8
# A row an infrastructure fault ended (after the agent loop waited out the outage, outage_wait_s in
# codegym_agent_loop.yaml) comes with a response mask of zeros: no gradient. codegym_grpo is verl's
# GRPO on the other rows, so that it does not shift its group's baseline either; verl computes
# advantages in its driver, where the Ray worker setup hook registers it
# (codegym_client/verl/advantage.py).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
DATA="${DATA:-data}"
MODEL="${MODEL:-Qwen/Qwen3-4B}"

python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=codegym_grpo \
    ++ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=codegym_client.verl.advantage.register \
    data.train_files="$DATA/codegym.parquet" \
    data.val_files="$DATA/codegym.val.parquet" \
    data.train_batch_size=64 \
    data.max_prompt_length=2048 \
    data.max_response_length=8192 \
    data.filter_overlong_prompts=True \
    data.return_raw_chat=True \
    actor_rollout_ref.model.path="$MODEL" \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=64 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.actor.use_kl_loss=False \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.mode=async \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.rollout.multi_turn.format=hermes \
    actor_rollout_ref.rollout.multi_turn.max_assistant_turns=64 \
    actor_rollout_ref.rollout.multi_turn.max_tool_response_length=2048 \
    actor_rollout_ref.rollout.agent.agent_loop_config_path="$HERE/codegym_agent_loop.yaml" \
    actor_rollout_ref.rollout.agent.default_agent_loop=codegym_agent \
    algorithm.use_kl_in_reward=False \
    trainer.project_name=codegym \
    trainer.experiment_name=grpo-codegym \
    trainer.logger='["console"]' \
    trainer.nnodes=1 \
    "$@"
