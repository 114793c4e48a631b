"""CodeGym's verl classes inside verl itself: `CodeGymAgentLoop` instantiated from
examples/verl/codegym_agent_loop.yaml the way verl's `AgentLoopWorker` does it, and `CodeGymTool`
driven by verl's own `ToolAgentLoop`, both against a real runtime serving the sample library.

verl brings torch and a few GB, so this file runs in a venv of its own: `make test-trainers` builds
it (verl, TRL, torch, the client) and runs this file there with `CODEGYM_TEST_RUNTIME` naming a
runtime it starts from the project's venv (tests/helpers/with_runtime.py). Elsewhere the file
skips; `CODEGYM_TESTS_REQUIRE_TRAINERS=1` (what `make test-trainers` sets) turns that skip into a
failure.

The model is scripted (recorded oracle trajectories as hermes tool calls) and the tokenizer a real
Hugging Face one built here with a ChatML template (codegym_testkit/trainer_script.py), so verl's Qwen
Continuous Token builder runs as it would for Qwen: the strongest check here is that our loop's
token stream is, token for token, the one verl's own `ToolAgentLoop` builds from the same turns.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
from pathlib import Path
from typing import Any, ClassVar

import pytest

from codegym_testkit.trainer_script import (
    ScriptedModel,
    ability,
    call_as_tool_agent_loop,
    chatml_tokenizer,
    hermes,
    trajectory,
)

REQUIRED = os.environ.get("CODEGYM_TESTS_REQUIRE_TRAINERS") == "1"
RUNTIME = os.environ.get("CODEGYM_TEST_RUNTIME", "").strip()
if importlib.util.find_spec("verl") is None or not RUNTIME:
    why = "needs verl and CODEGYM_TEST_RUNTIME (run `make test-trainers`)"
    if REQUIRED:
        raise RuntimeError(f"CODEGYM_TESTS_REQUIRE_TRAINERS=1: this file {why}")
    pytest.skip(why, allow_module_level=True)

from omegaconf import OmegaConf  # noqa: E402
from verl.experimental.agent_loop.agent_loop import (  # noqa: E402
    AgentLoopOutput,
)
from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop  # noqa: E402
from verl.tools.schemas import OpenAIFunctionToolSchema  # noqa: E402
from verl.workers.rollout.replica import TokenOutput  # noqa: E402

from codegym_client import AsyncRuntimeClient, SessionNotFound  # noqa: E402
from codegym_client.verl import AGENT_NAME, CodeGymAgentLoop, CodeGymTool  # noqa: E402
from codegym_testkit.verl_loops import AGENT_LOOP_YAML, instantiate, our_entry, trainer_config  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = chatml_tokenizer()
PROMPT = [{"role": "user", "content": "Solve the task with the tools."}]


class ServerManager:
    """verl's `LLMServerClient.generate` as the loops call it, answered by a scripted model."""

    def __init__(self, model: ScriptedModel, logprob: float | None = None) -> None:
        self.model = model
        self.logprob = logprob  # each generated token's log-prob, when the server returns them
        self.request_ids: list[str] = []
        self.sampling_params: list[dict[str, Any]] = []

    async def generate(
        self, request_id: str, *, prompt_ids: list[int], sampling_params: Any, **_: Any
    ) -> Any:
        self.request_ids.append(request_id)
        self.sampling_params.append(dict(sampling_params))
        ids = self.model.next_turn(prompt_ids)
        logprobs = None if self.logprob is None else [self.logprob] * len(ids)
        return TokenOutput(token_ids=ids, log_probs=logprobs, num_preempted=0)


def plain_turns(recorded: dict[str, Any]) -> list[str]:
    return [f"{hermes(action)}<|im_end|>" for action, _ in recorded["steps"]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_the_config_file_builds_the_loop_as_verl_does_and_an_episode_reaches_reward_1() -> None:
    recorded = trajectory("Sample_0006_I__ArrayGcdEnv")
    wrong = hermes('{"name": "Done", "parameters": {"answer": -1}}')
    server = ServerManager(
        ScriptedModel([f"<think>{wrong}</think>{t}" for t in plain_turns(recorded)], TOKENIZER)
    )
    loop = instantiate(our_entry(RUNTIME), trainer_config(), server, TOKENIZER)
    assert isinstance(loop, CodeGymAgentLoop)

    row = {"ability": ability(recorded), "raw_prompt": PROMPT, "index": 3, "priority": 3}
    output = await loop.run({"temperature": 1.0}, **row)

    assert isinstance(output, AgentLoopOutput)
    assert output.reward_score == 1.0
    assert output.extra_fields["codegym_infrastructure_failure"] is False
    assert output.extra_fields["codegym_steps"] == len(recorded["steps"])  # the calls in <think> not run
    assert len(set(server.request_ids)) == 1 and len(server.request_ids) == len(recorded["steps"])
    assert len(output.response_ids) == len(output.response_mask) and output.response_mask[-1] == 1
    assert TOKENIZER.decode(output.prompt_ids).endswith(
        "Solve the task with the tools.<|im_end|>\n<|im_start|>assistant\n"
    )
    # Qwen's builder puts the newline the template writes after <|im_end|> between a model turn
    # and the tool response: a token the model did not generate, so no loss on it.
    newline = TOKENIZER.encode("\n", add_special_tokens=False)[0]
    im_end = TOKENIZER.convert_tokens_to_ids("<|im_end|>")
    ends = [i for i, t in enumerate(output.response_ids[:-1]) if t == im_end and output.response_mask[i] == 1]
    assert ends and all(
        output.response_ids[i + 1] == newline and output.response_mask[i + 1] == 0 for i in ends
    )
    # What verl makes of the output: the reward at the last response token.
    tensors = output.as_dict()
    assert float(tensors["rm_scores"][-1]) == 1.0 and float(tensors["rm_scores"].sum()) == 1.0
    assert tensors["extra_fields"]["codegym_stop"] == "done"


@pytest.mark.parametrize("max_assistant_turns", [None, 3])
async def test_our_token_stream_is_the_one_verl_tool_agent_loop_builds_from_the_same_turns(
    max_assistant_turns: int | None,
) -> None:
    recorded = trajectory("Sample_0001_I__MaxSubarraySumEnv", 27)
    async with AsyncRuntimeClient(RUNTIME, timeout_s=30) as client:
        schemas = [json.loads(t.json_schema) for t in (await client.get_env(recorded["env_id"])).tools]
    config = trainer_config(max_assistant_turns=max_assistant_turns)

    ours_server = ServerManager(ScriptedModel(plain_turns(recorded), TOKENIZER), logprob=-0.5)
    ours = await instantiate(our_entry(RUNTIME), config, ours_server, TOKENIZER).run(
        {}, ability=ability(recorded), raw_prompt=PROMPT
    )

    # verl's own loop, with one CodeGymTool per tool (what tool_config(schemas, target) lists).
    tools = [CodeGymTool({"target": RUNTIME}, OpenAIFunctionToolSchema.model_validate(s)) for s in schemas]
    theirs_server = ServerManager(ScriptedModel(plain_turns(recorded), TOKENIZER), logprob=-0.5)
    verl_loop = instantiate(
        {"_target_": f"{ToolAgentLoop.__module__}.ToolAgentLoop"}, config, theirs_server, TOKENIZER, tools
    )
    row = {
        "raw_prompt": PROMPT,
        "tools_kwargs": {"Observe": {"create_kwargs": {"ability": ability(recorded)}}},
    }
    theirs = await verl_loop.run({}, **row)

    # The same session tools in the prompt (verl renders its schema model of them), the same tokens.
    assert ours.prompt_ids == theirs.prompt_ids
    # Log-probs: the model's where it generated, 0.0 on what it did not (tool messages, boundaries).
    assert ours.response_logprobs is not None and len(ours.response_logprobs) == len(ours.response_mask)
    assert ours.response_logprobs == [-0.5 if m else 0.0 for m in ours.response_mask]
    n = len(ours.response_ids)
    if max_assistant_turns:
        # Both stop right after the third model turn, its calls not run: the very same stream.
        assert (ours.response_ids, ours.response_mask) == (theirs.response_ids, theirs.response_mask)
        assert ours.response_logprobs == theirs.response_logprobs
        assert ours.extra_fields["codegym_stop"] == "max_turns" and ours.extra_fields["codegym_steps"] == 2
        assert ours.num_turns == theirs.num_turns == 2 + 3 + 1
        await tools[0].close_all()  # verl never tells a tool that its episode was cut short
        return
    # verl's loop goes on after the episode's end (the final observation, then one more model
    # turn); ours stops at the model's last call: ours is the start of theirs, mask included.
    assert n < len(theirs.response_ids)
    assert ours.response_ids == theirs.response_ids[:n]
    assert ours.response_mask == theirs.response_mask[:n]
    assert ours.response_logprobs == theirs.response_logprobs[:n]
    assert sum(ours.response_mask) > 0 and 0 in ours.response_mask
    # Every tool response verl's loop got through CodeGymTool is the recorded observation.
    assert sum(theirs.extra_fields["tool_rewards"]) == 1.0 and ours.reward_score == 1.0
    text = TOKENIZER.decode(theirs.response_ids)
    for _, observation in recorded["steps"]:
        assert f"<tool_response>\n{observation}\n</tool_response>" in text
    assert ours.num_turns == 2 * len(recorded["steps"])
    assert not CodeGymTool._sessions  # the step that ended the episode closed its session


def glm(action: str) -> str:
    """A call in GLM's XML format (verl's `glm` parser), which ends at `<|observation|>`."""
    call = json.loads(action)
    args = "".join(
        f"<arg_key>{k}</arg_key><arg_value>{json.dumps(v)}</arg_value>" for k, v in call["parameters"].items()
    )
    return f"<tool_call>{call['name']}{args}</tool_call><|observation|>"


async def test_another_format_parses_with_verls_parser_and_its_stop_token_is_asked_for() -> None:
    """`format: glm`: calls parsed by verl's GLM parser from its XML (arguments typed back from
    text), and `<|observation|>`, the parser's stop token, added to every turn's sampling parameters
    (as ToolAgentLoop adds it), keeping the trainer's own stop tokens."""
    tokenizer = chatml_tokenizer("<|observation|>")
    observation = tokenizer.convert_tokens_to_ids("<|observation|>")
    recorded = trajectory("Sample_0006_I__ArrayGcdEnv")
    server = ServerManager(ScriptedModel([glm(a) for a, _ in recorded["steps"]], tokenizer))
    entry = our_entry(RUNTIME)
    entry.format = "glm"
    loop = instantiate(entry, trainer_config(), server, tokenizer, hf_model_type="glm4")
    output = await loop.run(
        {"temperature": 1.0, "stop_token_ids": [7]}, ability=ability(recorded), raw_prompt=PROMPT
    )
    assert output.reward_score == 1.0 and output.extra_fields["codegym_steps"] == len(recorded["steps"])
    assert len(server.sampling_params) == len(recorded["steps"])
    for params in server.sampling_params:
        assert set(params["stop_token_ids"]) == {7, observation} and params["temperature"] == 1.0


async def test_the_tool_keeps_one_session_per_request_id_and_closes_it_at_the_end() -> None:
    recorded = trajectory("Sample_0006_I__ArrayGcdEnv")
    async with AsyncRuntimeClient(RUNTIME, timeout_s=30) as client:
        schemas = [json.loads(t.json_schema) for t in (await client.get_env(recorded["env_id"])).tools]
        tools = {
            s["function"]["name"]: CodeGymTool(
                {"target": RUNTIME}, OpenAIFunctionToolSchema.model_validate(s)
            )
            for s in schemas
        }

        class AgentData:  # what ToolAgentLoop passes as agent_data
            request_id = "episode-1"
            tools_kwargs: ClassVar = {"Observe": {"create_kwargs": {"ability": ability(recorded)}}}

        rewards, session_id = [], ""
        for action, observation in recorded["steps"]:
            response, reward = await call_as_tool_agent_loop(tools, action, AgentData)
            session_id = session_id or CodeGymTool._sessions[AgentData.request_id].session_id
            assert response.text == observation
            rewards.append(reward)
        assert sum(rewards) == 1.0 and rewards[-1] == 1.0
        assert AgentData.request_id not in CodeGymTool._sessions
        with pytest.raises(SessionNotFound):
            await client.get_session(session_id)


async def test_an_unreachable_runtime_is_flagged_in_the_output_and_no_model_turn_is_made() -> None:
    recorded = trajectory("Sample_0006_I__ArrayGcdEnv")
    server = ServerManager(ScriptedModel(plain_turns(recorded), TOKENIZER))
    entry = our_entry(f"127.0.0.1:{free_port()}")
    entry.timeout_s = 2
    entry.outage_wait_s = 0  # no outage to wait out: nothing listens there
    loop = instantiate(entry, trainer_config(), server, TOKENIZER)
    output = await loop.run({}, ability=ability(recorded), raw_prompt=PROMPT)
    assert output.extra_fields["codegym_infrastructure_failure"] is True
    assert "UNAVAILABLE" in output.extra_fields["codegym_failure_reason"]
    assert output.reward_score == 0.0 and output.response_mask == [0] and server.request_ids == []
    assert TOKENIZER.decode(output.prompt_ids).endswith(
        "Solve the task with the tools.<|im_end|>\n<|im_start|>assistant\n"
    )


def test_the_launch_script_overrides_compose_against_verls_trainer_config() -> None:
    """Every `key=value` of examples/verl/train_grpo.sh exists in verl's own `ppo_trainer` config
    (hydra refuses an unknown key), and the agent-loop settings land where AgentLoopWorker reads them."""
    import re

    import verl
    from hydra import compose, initialize_config_dir

    script = (ROOT / "examples" / "verl" / "train_grpo.sh").read_text()
    lines = re.findall(r"^\s{4}([+\w.]+=\S+) \\$", script, re.MULTILINE)
    values = {'"$DATA': "data", '"$HERE': str(AGENT_LOOP_YAML.parent), '"$MODEL"': "Qwen/Qwen3-4B"}
    overrides = []
    for line in lines:
        for name, value in values.items():
            line = line.replace(name, value)
        overrides.append(line.replace('"', ""))
    assert len(overrides) > 20 and any(o.startswith("actor_rollout_ref.rollout.agent.") for o in overrides)
    with initialize_config_dir(
        config_dir=str(Path(verl.__file__).parent / "trainer" / "config"), version_base=None
    ):
        config = compose(config_name="ppo_trainer", overrides=overrides)
    rollout = config.actor_rollout_ref.rollout
    assert Path(rollout.agent.agent_loop_config_path) == AGENT_LOOP_YAML
    assert rollout.agent.default_agent_loop == AGENT_NAME and rollout.multi_turn.format == "hermes"
    assert [e.name for e in OmegaConf.load(rollout.agent.agent_loop_config_path)] == [AGENT_NAME]
    # The estimator that leaves failed rows out of their group, registered in verl's driver (every
    # Ray worker of the job) by the setup hook the script gives Ray.
    assert config.algorithm.adv_estimator == "codegym_grpo"
    hook = config.ray_kwargs.ray_init.runtime_env.worker_process_setup_hook
    module, _, function = hook.rpartition(".")
    assert callable(getattr(importlib.import_module(module), function))


def test_codegym_grpo_is_verls_grpo_without_the_rows_that_have_no_token_to_train_on() -> None:
    """Through verl's own `compute_advantage`: a row with an all-zero response mask (what the loop
    hands verl for an infrastructure failure) gets advantage 0, and every other row gets exactly
    what verl's GRPO gives it in a batch without the failed rows; verl's plain GRPO would have
    measured them against the failed row's 0."""
    import numpy as np
    import torch
    from verl.protocol import DataProto
    from verl.trainer.ppo.ray_trainer import compute_advantage

    from codegym_client.verl.advantage import register

    assert "codegym_grpo" in register() and "codegym_grpo" in register()  # idempotent
    # Groups a, b (4 rollouts, one failed), c (2 rollouts, one failed) and d (all failed).
    uids = np.array(["a"] * 4 + ["b"] * 4 + ["c"] * 2 + ["d"] * 2, dtype=object)
    scores = [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    failed = [1, 6, 9, 10, 11]
    length = 5
    mask = torch.ones(len(scores), length)
    mask[:, -1] = 0  # padding
    mask[failed] = 0
    rewards = torch.zeros(len(scores), length)
    rewards[torch.arange(len(scores)), length - 2] = torch.tensor(scores)
    config = OmegaConf.create({"norm_adv_by_std_in_grpo": True})

    def advantages(name: str, rows: list[int]) -> Any:
        data = DataProto.from_dict(
            tensors={"token_level_rewards": rewards[rows], "response_mask": mask[rows]},
            non_tensors={"uid": uids[rows]},
        )
        return compute_advantage(data, adv_estimator=name, config=config).batch["advantages"]

    everyone = list(range(len(scores)))
    kept = [i for i in everyone if i not in failed]
    ours = advantages("codegym_grpo", everyone)
    assert torch.count_nonzero(ours[failed]) == 0
    assert torch.allclose(ours[kept], advantages("grpo", kept))
    assert not torch.allclose(advantages("grpo", everyone)[kept], ours[kept])  # the baseline it shifted
    # c is left with one rollout: verl's rule for a group of one (mean 0, std 1), its score.
    assert torch.allclose(ours[8], scores[8] * mask[8])


async def test_the_loop_records_its_episodes_under_the_trainers_experiment_name() -> None:
    """The loop's run id defaults to `trainer.experiment_name`: the runtime's record of the episode
    is the run's (`Stats`). No policy version: verl 0.9.1 gives an agent loop no step."""
    recorded = trajectory("Sample_0006_I__ArrayGcdEnv")
    config = trainer_config()
    config.trainer = {"experiment_name": "verl-real-experiment"}
    loop = instantiate(
        our_entry(RUNTIME), config, ServerManager(ScriptedModel(plain_turns(recorded), TOKENIZER)), TOKENIZER
    )
    output = await loop.run({}, ability=ability(recorded), raw_prompt=PROMPT)
    assert output.reward_score == 1.0
    async with AsyncRuntimeClient(RUNTIME, timeout_s=30) as client:
        tasks = [
            e.task
            for e in await client.stats("verl-real-experiment", played_only=True)
            if e.WhichOneof("entry") == "task"
        ]
    assert [(t.env_id, t.episodes, t.passes) for t in tasks] == [(recorded["env_id"], 1, 1)]


def test_the_curriculum_dataset_feeds_verls_dataloader_the_runtimes_choice(tmp_path: Path) -> None:
    """verl 0.9.1 dropped `data.sampler.class_path`; what its config still loads is a dataset class
    (`data.custom_cls`). Built by verl's own `create_rl_dataset` from a Parquet file of rows, and read
    through the dataloader verl's v1 trainer makes (`_init_dataloader`: its random sampler, its
    collate function, `train_batch_size` rows a batch), a batch is the runtime's choice of tasks for
    the run, seed `data.codegym.seed`; the validation set is served as it is."""
    import datasets
    from torch.utils.data import Sampler
    from torchdata.stateful_dataloader import StatefulDataLoader
    from verl.trainer.ppo.utils import create_rl_dataset, create_rl_sampler
    from verl.utils.dataset.rl_dataset import collate_fn

    from codegym_client import RuntimeClient
    from codegym_client.verl.sampler import CodeGymCurriculumDataset, CodeGymCurriculumSampler, task_key
    from codegym_testkit.trainer_script import TRAJECTORIES

    rows = [
        {
            "ability": ability(t),
            "prompt": [{"role": "user", "content": f"Task {i}."}],
            "extra_info": {"index": i},
        }
        for i, t in enumerate(TRAJECTORIES)
    ]
    train, val = tmp_path / "train.parquet", tmp_path / "val.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(train))
    datasets.Dataset.from_list(rows[:3]).to_parquet(str(val))
    root = OmegaConf.create(
        {
            "trainer": {"experiment_name": "verl-real-curriculum"},
            "data": {
                **OmegaConf.to_container(
                    OmegaConf.load(Path(verl_root()) / "trainer/config/data/legacy_data.yaml")
                ),
                "train_files": [str(train)],
                "val_files": [str(val)],
                "train_batch_size": 4,
                "tool_config_path": None,
                "function_tool_path": None,
                "custom_cls": {
                    "path": "pkg://codegym_client.verl.sampler",
                    "name": "CodeGymCurriculumDataset",
                },
                "codegym": {"target": RUNTIME, "seed": 9},
            },
        }
    )
    data = root.data
    dataset = create_rl_dataset(data.train_files, data, TOKENIZER, None)
    assert isinstance(dataset, CodeGymCurriculumDataset) and dataset.curriculum is not None
    assert (
        dataset.curriculum.run_id == "verl-real-curriculum"
    )  # trainer.experiment_name, from the config's root
    assert isinstance(dataset.curriculum, Sampler)
    loader = StatefulDataLoader(
        dataset=dataset,
        batch_size=data.train_batch_size,
        num_workers=0,
        drop_last=True,
        collate_fn=collate_fn,
        sampler=create_rl_sampler(data, dataset),
    )
    batch = next(iter(loader))
    with RuntimeClient(RUNTIME, timeout_s=30) as client:
        chosen = client.sample_tasks("verl-real-curriculum", 4, seed=9)
    keys = {task_key(t.ability) for t in chosen.tasks}
    assert len(batch["ability"]) == 4 and {task_key(a) for a in batch["ability"]} <= keys
    validation = create_rl_dataset(data.val_files, data, TOKENIZER, None)
    assert validation.curriculum is None and validation[1]["ability"] == rows[1]["ability"]
    # The sampler alone, as `RayPPOTrainer(train_sampler=...)` takes it: the same first batch.
    sampler = CodeGymCurriculumSampler(dataset, data)
    assert [dataset.dataframe[i]["ability"] for i in list(sampler)[:4]] == list(batch["ability"])


def verl_root() -> str:
    import verl

    return str(Path(verl.__file__).parent)
