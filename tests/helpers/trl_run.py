"""One step of TRL's own `GRPOTrainer` on CodeGym environments, driven through
`codegym_client.trl.CodeGymSpec` (`environment_factory`), with a scripted model.

`python -m tests.helpers.trl_run RUNTIME OUT.json` trains one GRPO step on three rows: the oracle
of ArrayGcd (reward 1), MaxSubarraySum played with a wrong final answer (reward 0), and
MergeIntervals left after two calls (no answer: reward 0, its session still open when training
ends). The envs have different tools, so the spec hands TRL a dict factory and TRL its
multi-environment path. It writes TRL's log history and the ids of the sessions the pooled
instances still hold (checked open in the runtime), then exits without closing anything, as a
training script does: the adapter's exit hook must close them (tests/test_trl_real.py checks that
from outside).

The model is codegym_testkit/scripted_lm.py's: a real `PreTrainedModel` whose backbone writes, at each
position, the one-hot vector of the scripted next token (the turns of the rollout's script, chosen
by the env's tools in the prompt: codegym_testkit/script.py), and whose LM head is a trainable
linear layer. So TRL generates, parses tool calls with its own response template, calls the
environment's methods, computes log-probs through its fused LM head and steps the optimizer.
The tokenizer is byte-level, with the Qwen2.5 chat template that TRL ships (read from the
installed package), which TRL's `add_response_schema` recognises.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import trl
from trl import GRPOConfig, GRPOTrainer

from codegym_client import RuntimeClient
from codegym_client.trl import CodeGymSpec
from codegym_testkit.script import Marked, Script, turns
from codegym_testkit.scripted_lm import ScriptConfig, ScriptedModel
from codegym_testkit.trainer_script import ability, chatml_tokenizer, trajectory

RIGHT = trajectory("Sample_0006_I__ArrayGcdEnv")
WRONG = trajectory("Sample_0001_I__MaxSubarraySumEnv", 3)
UNFINISHED = trajectory("Sample_0005_I__MergeIntervalsEnv")
UNFINISHED_CALLS = 2
# What tells the rollouts apart: a tool only that env has, in the system prompt's tool list.
WRONG_MARKER, UNFINISHED_MARKER = "ExtendOrRestart", "SortByStart"


def wrong_answer(recorded: dict[str, Any]) -> list[str]:
    """The recorded actions, the last one (`Done`) with an answer one off."""
    actions = [action for action, _ in recorded["steps"]]
    last = json.loads(actions[-1])
    assert last["name"] == "Done", last
    last["parameters"]["answer"] += 1
    return [*actions[:-1], json.dumps(last)]


def script(tokenizer: Any) -> Script:
    """Which rollout plays what, told apart by the env's tools in the prompt (`Marked`)."""
    unfinished = turns(tokenizer, (a for a, _ in UNFINISHED["steps"][:UNFINISHED_CALLS]))
    unfinished.append(tokenizer.encode("I stop here.<|im_end|>", add_special_tokens=False))
    choose = Marked(
        tokenizer,
        default=turns(tokenizer, (a for a, _ in RIGHT["steps"])),
        marked=[(WRONG_MARKER, turns(tokenizer, wrong_answer(WRONG))), (UNFINISHED_MARKER, unfinished)],
    )
    return Script(tokenizer, choose)


RUN_NAME = "trl-real-run"


def main(runtime: str, out: Path, curriculum: bool = False) -> None:
    """`curriculum`: the rows stream from `spec.curriculum()` (the runtime's choice for the run,
    which the spec's callback names after `run_name`) instead of `spec.train_dataset`."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    template = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()
    tokenizer = chatml_tokenizer(template=template)
    tokenizer.padding_side = "left"
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = ScriptConfig(vocab_size=len(tokenizer), eos_token_id=end, pad_token_id=tokenizer.pad_token_id)
    model = ScriptedModel(config, script(tokenizer))
    model.generation_config.use_cache = False

    rows = [{"ability": ability(RIGHT)}, {"ability": ability(WRONG)}, {"ability": ability(UNFINISHED)}]
    spec = CodeGymSpec(runtime, instances=rows)
    assert isinstance(spec.environment_factory, dict)  # two tool sets: TRL's multi-environment path
    args = GRPOConfig(
        output_dir=str(out.parent / "trl-output"),
        run_name=RUN_NAME + ("-curriculum" if curriculum else ""),
        shuffle_dataset=not curriculum,
        per_device_train_batch_size=6,
        num_generations=2,
        max_steps=1,
        max_completion_length=4096,
        max_tool_calling_iterations=64,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        generation_kwargs={"use_cache": False},
        save_strategy="no",
        seed=0,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=spec.reward_funcs,
        args=args,
        # One task per environment: the draw holds tasks the script finishes (an episode of the
        # unfinished environment alone is closed before its end, and an unended episode is not recorded).
        train_dataset=spec.curriculum(seed=5, per_env_cap=1) if curriculum else spec.train_dataset,
        processing_class=tokenizer,
        environment_factory=spec.environment_factory,
        callbacks=[spec.callback()],
    )
    trainer.train()
    # TRL keeps its pooled instances to the end and never closes them; neither does this script.
    pool = [env for envs in trainer._environment_pool.values() for env in envs]
    sessions = [
        env._session.session_id for env in pool if env._session is not None and env._session.session_id
    ]
    with RuntimeClient(runtime, timeout_s=30) as client:
        open_now = [s for s in sessions if client.get_session(s).session_id == s]
    record = {"run_id": spec.run.run_id, "policy_version": spec.run.policy_version}
    out.write_text(
        json.dumps({"log": trainer.state.log_history, "sessions": sessions, "open": open_now, "run": record})
    )


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), curriculum="--curriculum" in sys.argv[3:])
