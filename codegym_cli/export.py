"""Training instances in CodeGym's published format, built from the environment library.

One instance per task config:

    ability                codegym_v1@{code_id}__{Env}@{config json}
    answer                 "There is no answer" (the environment judges the answer)
    code_id, data_source   the source problem, "codegym_gym_v1"
    extra_info             index, solve_fc_round (oracle steps), difficulty, env_id, guess_rate
    plugin_call_max_round  256
    prompt                 system: the tool list (CodeGym's text form), user: protocol + task
    reward_model           {"ground_truth": null, "style": "agent_env"}

The text must match CodeGym's byte for byte (agents trained on its prompts see the same thing),
so the user message is CodeGym's protocol text verbatim and the system message is the contract's
tool renderer's output. `tools` adds OpenAI function schemas for native function calling.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from codegym.contract import format_ability, parse_ability
from codegym.library import EnvRecord

DATA_SOURCE = "codegym_gym_v1"
NO_ANSWER = "There is no answer"
PLUGIN_CALL_MAX_ROUND = 256
# CodeGym's interaction protocol, the user message before the task statement.
PROTOCOL = (
    "Please answer the following question step by step according to the requirements below!\n\n"
    "1. **Do not** write code to answer the user's question — you may only call the provided functions,"
    " and you may call at most **one function per step**.\n"
    "2. After you call a function, wait for the tool to return the result — do not assume what the result"
    " will be.\n"
    "3. If the tool’s description is unclear, you can try using it first, and then adjust your function"
    " call based on the returned result.\n"
    "4. Function calls should be wrapped with `<|FunctionCallBegin|>....<|FunctionCallEnd|>` and contain a"
    " JSON-formatted list. The list should include **one dictionary**, where each dictionary contains two"
    " parameters:\n\n"
    "   * `name`: the function name\n"
    "   * `parameters`: a dictionary of key-value pairs for the arguments\n\n"
    "Here’s an example of a function call:\n"
    '<|FunctionCallBegin|>[{"name":"function_name", "parameters":{"key1":"value1", "key2":"value2"}}]'
    "<|FunctionCallEnd|>\n\n"
    "**Extra requirements:**\n\n"
    "* Do not overthink; think briefly, then decide how to call the function.\n"
    "* Since you have many chances to call functions, you do not need to plan all steps in advance.\n"
    "* Do not try to solve the problem without using the tools."
)
# The same rules for native function calling (`--tools json`), where calls are not written as text.
NATIVE_PROTOCOL = (
    "Please answer the following question step by step by calling the provided tools.\n\n"
    "1. **Do not** write code to answer the user's question — you may only call the provided tools,"
    " and you may call at most **one tool per step**.\n"
    "2. After you call a tool, wait for its result — do not assume what the result will be.\n"
    "3. Submit your final answer with the `Done` tool.\n"
    "4. Do not try to solve the problem without using the tools."
)
TOOL_MODES = ("text", "json", "both")


def user_message(task_text: str, protocol: str = PROTOCOL) -> str:
    return f"{protocol}\n\nQuestion:\n\n\n{task_text.strip()}\n"


def instance(
    record: EnvRecord, config_json: str, *, index: int, extra: dict[str, Any], tools: str = "text"
) -> dict[str, Any]:
    """One training instance; keys in the order of CodeGym's published files."""
    if tools not in TOOL_MODES:
        raise ValueError(f"tools must be one of {', '.join(TOOL_MODES)}")
    config = json.loads(config_json)
    if tools == "json":
        prompt = [{"role": "user", "content": user_message(record.task_text, NATIVE_PROTOCOL)}]
    else:
        prompt = [
            {"role": "system", "content": record.tools_text, "name": "functions"},
            {"role": "user", "content": user_message(record.task_text), "name": ""},
        ]
    item: dict[str, Any] = {
        "ability": format_ability(record.code_id, record.env_class, config),
        "answer": NO_ANSWER,
        "code_id": record.code_id,
        "data_source": DATA_SOURCE,
        "extra_info": {"index": str(index), **extra},
        "plugin_call_max_round": PLUGIN_CALL_MAX_ROUND,
        "prompt": prompt,
        "reward_model": {"ground_truth": None, "style": "agent_env"},
    }
    if tools != "text":
        item["tools"] = [t.schema for t in record.tools]
    return item


@dataclass
class Difficulty:
    """Keep configs a model solved in `low`..`high` of its samples (`codegym eval`'s summary.json)."""

    rates: dict[str, float]
    name: str
    low: float = 0.0
    high: float = 1.0
    by_config: dict[tuple[str, str], float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Abilities are matched by env id and parsed config, however their JSON was spelled.
        for ability, value in self.rates.items():
            parsed = parse_ability(ability)
            self.by_config[(parsed.env_id, json.dumps(parsed.config, sort_keys=True))] = value

    @classmethod
    def from_summary(cls, path: str, low: float, high: float) -> Difficulty:
        summary = json.loads(Path(path).read_text(encoding="utf-8"))
        rates = {ability: float(c["success_rate"]) for ability, c in summary["configs"].items()}
        return cls(rates, str(summary["score_name"]), low, high)

    def rate(self, ability: str) -> float | None:
        parsed = parse_ability(ability)
        return self.by_config.get((parsed.env_id, json.dumps(parsed.config, sort_keys=True)))


@dataclass
class ExportResult:
    train: list[dict[str, Any]]
    validation: list[dict[str, Any]]
    environments: int
    held_out_environments: int
    skipped_unverified: int
    skipped_rounds: int
    skipped_difficulty: int = 0
    skipped_unevaluated: int = 0
    skipped_guessable: int = 0


def held_out(env_ids: Iterable[str], fraction: float) -> set[str]:
    """Whole environments for validation: the first ⌈fraction·n⌉ by a hash of the id (stable across runs)."""
    ids = sorted(env_ids, key=lambda e: hashlib.sha256(e.encode()).hexdigest())
    if fraction <= 0 or not ids:
        return set()
    return set(ids[: max(1, math.ceil(fraction * len(ids)))])


def build_instances(
    records: Iterable[EnvRecord],
    *,
    tools: str = "text",
    split: float = 0.0,
    min_rounds: int = 10,
    max_rounds: int = 256,
    include_unverified: bool = False,
    difficulty: Difficulty | None = None,
    max_guess_rate: float | None = None,
) -> ExportResult:
    """Every task config of every environment, filtered by oracle steps (and, given `difficulty`,
    by a model's success rate), split by environment."""
    records = list(records)
    validation_ids = held_out((r.env_id for r in records if r.tasks), split)
    result = ExportResult([], [], 0, 0, 0, 0)
    index = 0
    for record in records:
        kept = 0
        for task in record.tasks:
            if not task.solve_fc_round and not include_unverified:
                result.skipped_unverified += 1
                continue
            if task.solve_fc_round and not min_rounds <= task.solve_fc_round <= max_rounds:
                result.skipped_rounds += 1
                continue
            if (
                max_guess_rate is not None
                and task.guess_rate is not None
                and task.guess_rate > max_guess_rate
            ):
                result.skipped_guessable += 1
                continue
            extra: dict[str, Any] = {"solve_fc_round": task.solve_fc_round or None}
            if task.difficulty:
                extra["difficulty"] = task.difficulty
            extra["env_id"] = record.env_id
            if task.guess_rate is not None:
                extra["guess_rate"] = task.guess_rate
            extra.update(task.scores)
            if difficulty is not None:
                rate = difficulty.rate(
                    format_ability(record.code_id, record.env_class, json.loads(task.config_json))
                )
                if rate is None:
                    result.skipped_unevaluated += 1
                    continue
                if not difficulty.low <= rate <= difficulty.high:
                    result.skipped_difficulty += 1
                    continue
                extra[difficulty.name] = rate
            item = instance(record, task.config_json, index=index, extra=extra, tools=tools)
            index += 1
            kept += 1
            (result.validation if record.env_id in validation_ids else result.train).append(item)
        if kept and record.env_id in validation_ids:
            result.held_out_environments += 1
        elif kept:
            result.environments += 1
    return result
