"""The records of `codegym eval`: which attempts count, where they are written, the figures.

Only the agent's own outcomes are episodes (OUT/episodes.jsonl); attempts that ended because
something else failed are kept apart (OUT/failures.jsonl) and played again by the next run. The
summary is computed from the counted episodes only.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from codegym_jobs.appending import whole_lines

# The agent's own outcomes: the only end reasons that make an episode (figures, scores).
# context_length: the conversation outgrew the model's context window after the first turn (the
# endpoint's 400 says so): the model's limit, as the turn budget is, so the episode ends unsolved
# and counts. At the first turn the same 400 is a setting (`--max-tokens`): an llm_error.
COUNTED_REASONS = ("solved", "wrong_answer", "truncated", "format_errors", "context_length")
# Failures outside the agent: the attempt is recorded with its error and played again next run.
# runtime_error: a runtime call failed (unreachable, session lost, refused, internal error);
# llm_error: the endpoint failed past its retries or refused the request;
# internal_error: anything else (a bug of the evaluation loop itself).
FAILURE_REASONS = ("runtime_error", "llm_error", "internal_error")


def pass_at_k(samples: int, solved: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    if samples - solved < k:
        return 1.0
    return 1.0 - math.comb(samples - solved, k) / math.comb(samples, k)


def score_name(model: str, samples: int) -> str:
    """CodeGym's name for a per-config success rate, e.g. `qwen32b_Bo4_score`."""
    return f"{re.sub(r'[^A-Za-z0-9.-]+', '-', model).strip('-') or 'model'}_Bo{samples}_score"


def is_counted(item: dict[str, Any]) -> bool:
    """An episode that counts: the agent's own outcome. Lines written before failures were kept
    apart (a `runtime_error` or `llm_error` in episodes.jsonl) are failures too."""
    return item.get("end_reason") in COUNTED_REASONS


def read_lines(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSONL file that have a key (a line cut by an interruption is not one)."""
    items: list[dict[str, Any]] = []
    for line in whole_lines(path):
        try:
            item = json.loads(line)
            str(item["key"])
        except (ValueError, KeyError, TypeError):
            continue
        items.append(item)
    return items


def done_keys(path: Path) -> set[str]:
    """Episodes already counted: a rerun plays everything else, failed attempts included."""
    return {item["key"] for item in read_lines(path) if is_counted(item)}


def failures_path(episodes: Path) -> Path:
    """Failed attempts live beside the episodes, never among them: whoever reads episodes.jsonl
    (as training data, or for figures) gets only the agent's own outcomes."""
    return episodes.with_name("failures.jsonl")


def summarize(path: Path, samples: int, model: str) -> dict[str, Any]:
    """Figures per environment and overall, and the success rate of every task config.

    Only counted episodes enter a figure. Failed attempts not since played to an end are
    reported apart (`not_counted`: how many, why, the most frequent errors); a config with no
    counted episode has no success rate at all (it is absent from `configs`).
    """
    episodes: dict[str, dict[str, Any]] = {}
    failures: dict[str, dict[str, Any]] = {}
    for item in read_lines(path) + read_lines(failures_path(path)):
        (episodes if is_counted(item) else failures)[item["key"]] = item
    outstanding = {key: item for key, item in failures.items() if key not in episodes}
    by_task: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for item in episodes.values():
        by_task[item["ability"]].append(item)
    failed_by_task: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for item in outstanding.values():
        failed_by_task[item["ability"]].append(item)

    def not_counted(items: list[dict[str, Any]]) -> dict[str, Any]:
        errors = Counter(str(e.get("error") or e["end_reason"]).splitlines()[0][:300] for e in items)
        return {
            "episodes": len(items),
            "reasons": dict(Counter(e["end_reason"] for e in items)),
            "errors": [{"error": text, "episodes": n} for text, n in errors.most_common(5)],
        }

    def figures(abilities: list[str]) -> dict[str, Any]:
        tasks = [t for t in abilities if by_task.get(t)]
        items = [e for t in tasks for e in by_task[t]]
        failed = [e for t in abilities for e in failed_by_task.get(t, [])]
        if not items:
            return {"tasks": 0, "episodes": 0, "not_counted": len(failed)} if failed else {}
        solved = [sum(e["end_reason"] == "solved" for e in by_task[t]) for t in tasks]
        counts = [len(by_task[t]) for t in tasks]
        return {
            "tasks": len(tasks),
            "episodes": len(items),
            "success_rate": round(sum(solved) / len(items), 4),
            "pass@1": round(
                sum(pass_at_k(n, c, 1) for n, c in zip(counts, solved, strict=True)) / len(tasks), 4
            ),
            f"pass@{samples}": round(
                sum(pass_at_k(n, c, min(samples, n)) for n, c in zip(counts, solved, strict=True))
                / len(tasks),
                4,
            ),
            "mean_turns": round(sum(e["turns"] for e in items) / len(items), 2),
            "prompt_tokens": sum(e["prompt_tokens"] for e in items),
            "completion_tokens": sum(e["completion_tokens"] for e in items),
            "end_reasons": dict(Counter(e["end_reason"] for e in items)),
            "not_counted": len(failed),
        }

    envs: dict[str, list[str]] = defaultdict(list)
    for ability in sorted(set(by_task) | set(failed_by_task)):
        items = by_task.get(ability) or failed_by_task[ability]
        envs[items[0]["env_id"]].append(ability)
    name = score_name(model, samples)
    return {
        "model": model,
        "samples": samples,
        "score_name": name,
        "overall": figures([a for abilities in envs.values() for a in abilities]),
        "not_counted": not_counted(list(outstanding.values())),
        "environments": {env: figures(abilities) for env, abilities in sorted(envs.items())},
        "configs": {
            ability: {
                "env_id": items[0]["env_id"],
                "samples": len(items),
                "solved": sum(e["end_reason"] == "solved" for e in items),
                "success_rate": round(sum(e["end_reason"] == "solved" for e in items) / len(items), 4),
                "not_counted": len(failed_by_task.get(ability, [])),
            }
            for ability, items in sorted(by_task.items())
        },
    }
