"""The soak's real TRL path: TRL's own `GRPOTrainer` training on CodeGym through
`codegym_client.trl.CodeGymSpec`, playing recorded oracle trajectories, one JSON line per episode.

Why: bench/soak.py drives the adapter's `environment_factory` contract by hand (reset, then tool
methods from threads), so what it checks is the adapter, not what TRL makes of it. This process is
a trainer: it runs in the trainers' venv (TRL, transformers, torch CPU, the client), hands the
spec's environment classes to `GRPOTrainer` and trains GRPO steps until `--minutes` have passed,
so TRL generates, parses the tool calls with its own response schema, calls the environments'
methods in its tool loop, scores the rollouts (`get_reward`) and steps the optimizer, while the
soak runs its faults against the servers. The soak counts the lines it prints, and a process that
died (an `InfrastructureFailure` or any other error out of `trainer.train()`).

    .venv-trainers/bin/python bench/soak_trl.py --target HOST:PORT[,HOST:PORT] --minutes M \\
        [--batch 8] [--outage-wait-s 600] [--max-steps-per-episode 12]

How:

- Rows: the recorded trajectories (codegym/samples/trajectories.jsonl) with at most
  `--max-steps-per-episode` steps (generation costs a forward per token on a shared CPU), one
  dataset row each, the spec's row with `[trajectory K]` as its prompt's text and a `trajectory`
  column (TRL passes the row's columns to `reset`).
- The model (codegym_testkit/scripted_lm.py): a real `PreTrainedModel` whose backbone writes, at
  each position, the one-hot vector of the scripted next token and whose LM head is a trainable
  linear layer. Its script (codegym_testkit/script.py, `Tagged`) reads `[trajectory K]` from the
  input ids and plays trajectory K's recorded actions as hermes tool calls, one per assistant
  turn, then ends its turn without a call (which ends TRL's tool loop). The tokenizer is
  byte-level, with TRL's Qwen2.5 template.
- Recording: each environment class of `spec.environment_factory` is subclassed (same name, so
  TRL's reward column keeps it) with each tool method wrapped to record what it returned or
  raised for the current episode (from `reset` to the next); the wrappers keep the names,
  signatures, annotations and docstrings TRL renders the tools from (checked against the
  originals with transformers' `get_json_schema` at start), and add no public method.
- Per generation batch (`_generate_and_score_completions`, subclassed) each rollout's episode is
  judged with the rewards TRL computed for it (`_calculate_rewards`) and its advantage:

    finished  every observation equal to its recording, the episode ended (done) with the
              recording's last step, and TRL scored it with the recorded reward
    shaped    an observation (or the first one, in reset's text, or the reward) differed from the
              recording: `example` says where and what came back; a fault must never cause this
    failed    the infrastructure failed the episode and it was marked so TRL does not learn from it:
              `get_reward()` None, the trainer's reward NaN (`reward_seen` null) and advantage 0;
              `reason` is the `CodeGymError` reason
    lost      anything else: a tool error shown to the model without the episode failed, an episode
              stopped before its end, a failed episode TRL scored anyway

  Line: {"path": "trl", "env_id", "outcome", "reason", "steps", "example", "trajectory",
  "reward_seen" (the reward TRL's trainer computed; null for NaN, i.e. unscored), "advantage"}.
- Training stops at the first step end after `--minutes` (a callback), exit 0. If `trainer.train()`
  raises anything (`InfrastructureFailure` is a `BaseException`), a line {"path": "trl",
  "outcome": "died", "reason": ...} is printed and the error propagates: non-zero exit.
- stdout carries only these lines: file descriptor 1 is pointed at stderr at start (TRL's and
  transformers' own prints go to the log there), the lines go to a copy of the original.
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import math
import os
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, TextIO

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import trl  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from transformers.utils import get_json_schema  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from bench.judge import Judge  # noqa: E402
from codegym_client.errors import CodeGymError  # noqa: E402
from codegym_client.trl import CodeGymEnvironment, CodeGymSpec  # noqa: E402
from codegym_testkit.script import TAG, Script, Tagged  # noqa: E402
from codegym_testkit.scripted_lm import ScriptConfig, ScriptedModel  # noqa: E402
from codegym_testkit.trainer_script import TRAJECTORIES, ability, chatml_tokenizer, hermes  # noqa: E402

log = logging.getLogger("soak_trl")
Line = dict[str, Any]
RESERVED = ("reset", "get_reward")


# -- Output --------------------------------------------------------------------------------------


class Out:
    """The JSON lines, on the process's original stdout; everything else written to fd 1 or
    `sys.stdout` goes to stderr."""

    def __init__(self) -> None:
        sys.stdout.flush()
        self.stream: TextIO = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
        os.dup2(2, 1)
        sys.stdout = sys.stderr
        self.lock = threading.Lock()
        self.outcomes: Counter[str] = Counter()

    def line(self, record: dict[str, Any]) -> None:
        with self.lock:
            self.stream.write(json.dumps(record) + "\n")
            self.stream.flush()
            self.outcomes[str(record.get("outcome"))] += 1


# -- Recording environments ----------------------------------------------------------------------


class RolloutRecord:
    """What one rollout's environment returned to TRL, from `reset` to the next."""

    def __init__(self, row: dict[str, Any]) -> None:
        self.trajectory = row.get("trajectory")
        self.env_id = str(row.get("env_id", ""))
        self.reset_text: str | None = None
        self.reset_failed = False  # CreateSession failed: reset's text says so, not the first observation
        self.calls: list[tuple[str, bool, Any]] = []  # (tool, raised, returned value or exception)


def recording_method(method: Any) -> Any:
    """`method` (a tool) recording its outcome in the instance's current episode, with the name,
    signature, annotations and docstring TRL reads."""

    def tool(self: Any, **arguments: Any) -> Any:
        episode = self._soak_episode
        try:
            result = method(self, **arguments)
        except BaseException as exc:
            if episode is not None:
                episode.calls.append((method.__name__, True, exc))
            raise
        if episode is not None:
            episode.calls.append((method.__name__, False, result))
        return result

    tool.__name__ = method.__name__
    tool.__qualname__ = method.__qualname__
    tool.__module__ = method.__module__
    tool.__doc__ = method.__doc__
    tool.__annotations__ = dict(method.__annotations__)
    tool.__signature__ = inspect.signature(method)  # type: ignore[attr-defined]
    return tool


def recording_class(cls: type[CodeGymEnvironment]) -> type[CodeGymEnvironment]:
    """A subclass of `cls` of the same name that records each episode's observations."""
    base_reset = cls.reset

    def __init__(self: Any) -> None:
        cls.__init__(self)
        self._soak_episode = None

    def reset(self: Any, **row: Any) -> str:
        episode = self._soak_episode = RolloutRecord(row)
        text = base_reset(self, **row)
        episode.reset_text, episode.reset_failed = text, self._session.failure is not None
        return text

    reset.__doc__ = base_reset.__doc__
    namespace: dict[str, Any] = {
        "__init__": __init__,
        "reset": reset,
        "__module__": cls.__module__,
        "__doc__": cls.__doc__,
        "__qualname__": cls.__qualname__,
    }
    tools = [
        name
        for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
        if not name.startswith("_") and name not in RESERVED
    ]
    for name in tools:
        namespace[name] = recording_method(getattr(cls, name))
    sub = type(cls.__name__, (cls,), namespace)
    # TRL renders the tools from the methods: the wrapped ones must render as the originals do.
    public = sorted(n for n, _ in inspect.getmembers(sub, inspect.isfunction) if not n.startswith("_"))
    assert public == sorted([*tools, *RESERVED]), (public, tools)
    for name in tools:
        assert get_json_schema(getattr(sub, name)) == get_json_schema(getattr(cls, name)), name
    return sub


def recording_factory(factory: Any) -> Any:
    if isinstance(factory, dict):
        made: dict[type, type] = {}  # one subclass per class, even under several names
        for cls in factory.values():
            if cls not in made:
                made[cls] = recording_class(cls)
        return {name: made[cls] for name, cls in factory.items()}
    return recording_class(factory)


# -- Judging episodes ----------------------------------------------------------------------------


def failure_reason(exc: BaseException | None) -> str:
    while exc is not None and not isinstance(exc, CodeGymError) and exc.__cause__ is not None:
        exc = exc.__cause__
    if isinstance(exc, CodeGymError):
        return exc.reason or type(exc).__name__
    return type(exc).__name__ if exc is not None else "unknown"


def short(value: Any, n: int = 160) -> str:
    text = str(value)
    return text if len(text) <= n else text[:n] + "..."


def judge(env: Any, lines: list[Line], reward_seen: float | None, advantage: float | None) -> dict[str, Any]:
    """One rollout's line (see the module docstring)."""
    episode: RolloutRecord | None = env._soak_episode
    out: dict[str, Any] = {"path": "trl", "env_id": "", "outcome": "lost", "reason": "", "steps": 0}
    out |= {"example": "", "trajectory": None, "reward_seen": reward_seen, "advantage": advantage}
    if episode is None or not isinstance(episode.trajectory, int):
        out["reason"] = "no episode recorded for this rollout"
        return out
    line = lines[episode.trajectory]
    out |= {"env_id": line["env_id"], "trajectory": episode.trajectory}
    returned = [(tool, value) for tool, raised, value in episode.calls if not raised]
    raised = [(tool, value) for tool, is_raised, value in episode.calls if is_raised]
    out["steps"] = len(returned)
    failure = env._session.failure
    # Shaped: an observation the trainer saw that is not the recorded one (a failure does not excuse it).
    first = str(line.get("first", ""))
    if not episode.reset_failed and first and not str(episode.reset_text or "").endswith(first):
        out |= {"outcome": "shaped", "reason": "first observation differs"}
        out["example"] = f"reset: {short(episode.reset_text)!r} (recorded first {short(first, 60)!r})"
        return out
    for index, ((tool, _), (action, _)) in enumerate(zip(returned, line["steps"], strict=False)):
        if tool != json.loads(action)["name"]:
            out |= {"outcome": "shaped", "reason": "tool differs"}
            out["example"] = f"step {index}: {tool} (recorded {json.loads(action)['name']})"
            return out
    judge = Judge(line)
    for _, value in returned:
        if not judge.saw(str(value)):
            break
    if raised and failure is None and not judge.shaped:
        tool, exc = raised[0]
        out["reason"] = f"{tool} raised {type(exc).__name__} without the episode failed"
        out["example"] = short(exc)
        return out
    verdict = judge.verdict(
        failure=failure_reason(failure) if failure is not None else None,
        done=bool(env._session.done),
        reward=math.nan if reward_seen is None else reward_seen,  # NaN: TRL left it unscored
    )
    out |= {"outcome": verdict.outcome, "reason": verdict.reason, "example": verdict.example}
    if verdict.outcome == "failed":  # marked: neither the adapter nor TRL may have scored it
        out["example"] = (
            f"shown to the model: {next((short(v) for _, v in raised), short(episode.reset_text))}"
        )
        if env.get_reward() is not None:
            out["outcome"], out["reason"] = (
                "lost",
                f"failed ({verdict.reason}) but get_reward() gave a reward",
            )
        elif reward_seen is not None:
            out["outcome"], out["reason"] = (
                "lost",
                f"failed ({verdict.reason}) but TRL scored it {reward_seen}",
            )
        elif advantage is not None and advantage != 0.0:
            out["outcome"], out["reason"] = "lost", f"failed ({verdict.reason}) but advantage {advantage}"
    return out


class SoakTrainer(GRPOTrainer):
    """`GRPOTrainer` reporting each rollout's episode once its batch is scored."""

    def __init__(self, *args: Any, soak_lines: list[Line], soak_out: Out, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._soak_lines = soak_lines
        self._soak_out = soak_out
        self._soak_rewards: torch.Tensor | None = None
        self.soak_episodes = 0

    def _calculate_rewards(
        self, inputs: Any, prompts: Any, completions: Any, completion_ids_list: Any
    ) -> Any:
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._soak_rewards = rewards.detach().float().cpu()
        return rewards

    def _generate_and_score_completions(self, inputs: Any) -> Any:
        self._soak_rewards = None
        output = super()._generate_and_score_completions(inputs)
        advantages = output.get("advantages")
        for i, env in enumerate(self.environments or []):
            reward_seen = None
            if self._soak_rewards is not None and i < len(self._soak_rewards):
                row = self._soak_rewards[i]
                if not bool(torch.isnan(row).all()):
                    reward_seen = float(torch.nansum(row * self.reward_weights.cpu()))
            advantage = float(advantages[i]) if advantages is not None and i < len(advantages) else None
            self._soak_out.line(judge(env, self._soak_lines, reward_seen, advantage))
            self.soak_episodes += 1
        return output


class Deadline(TrainerCallback):
    """Stop training at the first step end after `until` (monotonic)."""

    def __init__(self, until: float) -> None:
        self.until = until

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if time.monotonic() >= self.until:
            control.should_training_stop = True
        return control


# -- Main ----------------------------------------------------------------------------------------


def completion_budget(lines: list[Line]) -> int:
    """Tokens (bytes) of the longest episode's completion: its calls, the tool responses and the
    template around them, with room to spare."""
    longest = 0
    for line in lines:
        total = sum(len(hermes(a).encode()) + len(o.encode()) + 80 for a, o in line["steps"])
        longest = max(longest, total)
    return int(longest * 1.5) + 1024


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", required=True, help="the runtime(s): HOST:PORT[,HOST:PORT]")
    parser.add_argument("--minutes", type=float, required=True, help="train until this long has passed")
    parser.add_argument("--batch", type=int, default=8, help="rollouts per step (2 generations per row)")
    parser.add_argument("--outage-wait-s", type=float, default=600.0, help="the adapter's outage wait")
    parser.add_argument("--max-steps-per-episode", type=int, default=12, help="play recordings this short")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.batch < 2 or args.batch % 2:
        parser.error("--batch must be a positive even number (num_generations is 2)")

    out = Out()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(1)
    started = time.monotonic()
    until = started + args.minutes * 60
    lines = [t for t in TRAJECTORIES if 0 < len(t["steps"]) <= args.max_steps_per_episode]
    if not lines:
        parser.error(f"no recorded trajectory has at most {args.max_steps_per_episode} steps")
    trainer: SoakTrainer | None = None
    scratch = tempfile.TemporaryDirectory(prefix="codegym-soak-trl-")
    try:
        spec = CodeGymSpec(
            args.target,
            instances=[{"ability": ability(line)} for line in lines],
            outage_wait_s=args.outage_wait_s,
        )
        rows = []
        for k, row in enumerate(spec.rows):
            rows.append(
                row | {"prompt": [{"role": "user", "content": TAG.format(k) + "\n\n"}], "trajectory": k}
            )
        import datasets

        template = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()
        tokenizer = chatml_tokenizer(template=template)
        tokenizer.padding_side = "left"
        end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        config = ScriptConfig(
            vocab_size=len(tokenizer), eos_token_id=end, pad_token_id=tokenizer.pad_token_id
        )
        model = ScriptedModel(config, Script(tokenizer, Tagged(tokenizer, lines)))
        model.generation_config.use_cache = False
        grpo = GRPOConfig(
            output_dir=scratch.name,  # nothing is saved; removed at exit
            per_device_train_batch_size=args.batch,
            num_generations=2,
            max_steps=10**9,  # the deadline stops it
            max_completion_length=completion_budget(lines),
            max_tool_calling_iterations=args.max_steps_per_episode + 2,
            logging_steps=1,
            report_to=[],
            use_cpu=True,
            bf16=False,
            gradient_checkpointing=False,
            generation_kwargs={"use_cache": False},
            save_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
            seed=args.seed,
        )
        trainer = SoakTrainer(
            model=model,
            reward_funcs=spec.reward_funcs,
            args=grpo,
            train_dataset=datasets.Dataset.from_list(rows),
            processing_class=tokenizer,
            environment_factory=recording_factory(spec.environment_factory),
            callbacks=[Deadline(until)],
            soak_lines=lines,
            soak_out=out,
        )
        log.info(
            "training on %d recordings of %d envs at %s for %g min (batch %d, outage wait %g s)",
            len(lines),
            len({line["env_id"] for line in lines}),
            args.target,
            args.minutes,
            args.batch,
            args.outage_wait_s,
        )
        trainer.train()
    except KeyboardInterrupt:
        log.warning("interrupted")
        return 130
    except BaseException as exc:
        out.line({"path": "trl", "outcome": "died", "reason": f"{type(exc).__name__}: {short(exc, 400)}"})
        log.exception("the TRL run died")
        raise
    minutes = (time.monotonic() - started) / 60
    episodes = trainer.soak_episodes
    log.info(
        "%d episodes in %d steps, %.1f min: %.1f episodes/min; %s",
        episodes,
        trainer.state.global_step,
        minutes,
        episodes / minutes if minutes else 0.0,
        dict(out.outcomes),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
