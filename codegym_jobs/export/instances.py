"""Training instances in CodeGym's published format, built from the environment library.

One instance per task config:

    ability                codegym_v1@{code_id}__{Env}@{config}, the config as published, byte for byte
    answer                 "There is no answer" (the environment judges the answer)
    code_id, data_source   the source problem, "codegym_gym_v1"
    extra_info             index, solve_fc_round (oracle steps), difficulty, env_id, guess_rate,
                           learnability (`codegym library label`), model scores
    plugin_call_max_round  256
    prompt                 system: the tool list (CodeGym's text form), user: protocol + task
    reward_model           {"ground_truth": null, "style": "agent_env"}

The text must match CodeGym's byte for byte (agents trained on its prompts see the same thing),
so the user message is CodeGym's protocol text verbatim and the system message is the contract's
tool renderer's output. `tools` adds OpenAI function schemas for native function calling.

Built one environment at a time (`iter_instances`): CodeGym's published library is 22,366
environments and 80,130 task configs, and `codegym export` writes each row as it is made.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import math
from collections.abc import Container, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from codegym.contract import parse_ability
from codegym.library.records import TOOL_MODES
from codegym.library.store import EnvRecord
from codegym_client.abilities import make_ability

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


def user_message(task_text: str, protocol: str = PROTOCOL) -> str:
    return f"{protocol}\n\nQuestion:\n\n\n{task_text.strip()}\n"


def ability(record: EnvRecord, config_text: str) -> str:
    """The ability string of one task config, with `config_text` as it stands: never re-serialised,
    so a published config keeps its spelling (separators, escapes, key order) byte for byte."""
    return make_ability(f"{record.code_id}__{record.env_class}", config_text)


def instance(
    record: EnvRecord, config_text: str, *, index: int, extra: dict[str, Any], tools: str = "text"
) -> dict[str, Any]:
    """One training instance; keys in the order of CodeGym's published files. `config_text` is the
    task config as published (`TaskRecord.published_config`): the ability carries it verbatim."""
    if tools not in TOOL_MODES:
        raise ValueError(f"tools must be one of {', '.join(TOOL_MODES)}")
    if tools == "json":
        prompt = [{"role": "user", "content": user_message(record.task_text, NATIVE_PROTOCOL)}]
    else:
        prompt = [
            {"role": "system", "content": record.tools_text, "name": "functions"},
            {"role": "user", "content": user_message(record.task_text), "name": ""},
        ]
    item: dict[str, Any] = {
        "ability": ability(record, config_text),
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


def config_key(env_id: str, config: dict[str, Any]) -> tuple[str, str]:
    """A task config however its JSON was spelled: env id and the config with sorted keys."""
    return env_id, json.dumps(config, sort_keys=True)


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
        for ability_text, value in self.rates.items():
            parsed = parse_ability(ability_text)
            self.by_config[config_key(parsed.env_id, parsed.config)] = value

    @classmethod
    def from_summary(cls, path: str, low: float, high: float) -> Difficulty:
        summary = json.loads(Path(path).read_text(encoding="utf-8"))
        rates = {ability: float(c["success_rate"]) for ability, c in summary["configs"].items()}
        return cls(rates, str(summary["score_name"]), low, high)

    def rate(self, ability_text: str) -> float | None:
        parsed = parse_ability(ability_text)
        return self.by_config.get(config_key(parsed.env_id, parsed.config))

    def rate_of(self, env_id: str, config_json: str) -> float | None:
        """The rate of a stored task config (its canonical JSON)."""
        return self.by_config.get(config_key(env_id, json.loads(config_json)))


class HeldOut:
    """The environments `--split` holds out for validation, whole: the first ⌈fraction·n⌉ of the n
    environments with task configs, ordered by the sha256 of their ids (stable across runs, and
    the same choice as ever). Built from the ids alone, in one pass; then each environment is
    asked before its rows are written, so the rows stream."""

    def __init__(self, env_ids: Iterable[str], fraction: float) -> None:
        self.fraction = fraction
        self.threshold: bytes | None = None
        if fraction <= 0:
            return
        digests = [_digest(env_id) for env_id in env_ids]
        if digests:
            count = max(1, math.ceil(fraction * len(digests)))
            self.threshold = heapq.nsmallest(count, digests)[-1]

    def __contains__(self, env_id: object) -> bool:
        return self.threshold is not None and isinstance(env_id, str) and _digest(env_id) <= self.threshold


def _digest(env_id: str) -> bytes:
    # Bytes order as their hex digests do: the split is the one sorted hex digests always gave.
    return hashlib.sha256(env_id.encode()).digest()


@dataclass
class ExportCounts:
    """What an export kept and dropped, counted as the rows go by."""

    train: int = 0
    validation: int = 0
    environments: int = 0
    held_out_environments: int = 0
    skipped_unverified: int = 0
    skipped_rounds: int = 0
    skipped_difficulty: int = 0
    skipped_unevaluated: int = 0
    skipped_guessable: int = 0
    skipped_learnability: int = 0


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
    skipped_learnability: int = 0


def iter_instances(
    records: Iterable[EnvRecord],
    counts: ExportCounts,
    *,
    tools: str = "text",
    held_out: Container[str] = frozenset(),
    min_rounds: int = 10,
    max_rounds: int = 256,
    include_unverified: bool = False,
    difficulty: Difficulty | None = None,
    max_guess_rate: float | None = None,
    learnability: Container[str] | None = None,
) -> Iterator[tuple[bool, dict[str, Any]]]:
    """(held out?, instance) for every task config of every environment that passes the filters
    (oracle steps, guess rate, given `learnability` the labels kept, and given `difficulty`, a
    model's success rate), in the records' order, made one at a time; `counts` counts as they go
    (complete once the iterator is done)."""
    index = 0
    for record in records:
        validation = record.env_id in held_out
        kept = 0
        for task in record.tasks:
            if not task.solve_fc_round and not include_unverified:
                counts.skipped_unverified += 1
                continue
            if task.solve_fc_round and not min_rounds <= task.solve_fc_round <= max_rounds:
                counts.skipped_rounds += 1
                continue
            if (
                max_guess_rate is not None
                and task.guess_rate is not None
                and task.guess_rate > max_guess_rate
            ):
                counts.skipped_guessable += 1
                continue
            if learnability is not None and task.learnability not in learnability:
                counts.skipped_learnability += 1
                continue
            extra: dict[str, Any] = {"solve_fc_round": task.solve_fc_round or None}
            if task.difficulty:
                extra["difficulty"] = task.difficulty
            extra["env_id"] = record.env_id
            if task.guess_rate is not None:
                extra["guess_rate"] = task.guess_rate
            if task.learnability:
                extra["learnability"] = task.learnability
            extra.update(task.scores)
            if difficulty is not None:
                rate = difficulty.rate_of(f"{record.code_id}__{record.env_class}", task.config_json)
                if rate is None:
                    counts.skipped_unevaluated += 1
                    continue
                if not difficulty.low <= rate <= difficulty.high:
                    counts.skipped_difficulty += 1
                    continue
                extra[difficulty.name] = rate
            item = instance(record, task.published_config, index=index, extra=extra, tools=tools)
            index += 1
            kept += 1
            if validation:
                counts.validation += 1
            else:
                counts.train += 1
            yield validation, item
        if kept and validation:
            counts.held_out_environments += 1
        elif kept:
            counts.environments += 1


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
    learnability: Container[str] | None = None,
) -> ExportResult:
    """`iter_instances` into lists, split by environment (`HeldOut`): for a few records (tests,
    `codegym eval`); `codegym export` streams instead."""
    records = list(records)
    counts = ExportCounts()
    result = ExportResult([], [], 0, 0, 0, 0)
    for validation, item in iter_instances(
        records,
        counts,
        tools=tools,
        held_out=HeldOut((r.env_id for r in records if r.tasks), split),
        min_rounds=min_rounds,
        max_rounds=max_rounds,
        include_unverified=include_unverified,
        difficulty=difficulty,
        max_guess_rate=max_guess_rate,
        learnability=learnability,
    ):
        (result.validation if validation else result.train).append(item)
    result.environments = counts.environments
    result.held_out_environments = counts.held_out_environments
    result.skipped_unverified = counts.skipped_unverified
    result.skipped_rounds = counts.skipped_rounds
    result.skipped_difficulty = counts.skipped_difficulty
    result.skipped_unevaluated = counts.skipped_unevaluated
    result.skipped_guessable = counts.skipped_guessable
    result.skipped_learnability = counts.skipped_learnability
    return result
