"""What the environment library holds, as plain records: environments, their tools and task configs.

Kept apart from the SQLite store (library.py) and from importing (library_import.py): the runtime,
the pipeline, export and eval all read these.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

DIFFICULTIES = ("", "easy", "medium", "hard")
QUESTION_MARKER = "\nQuestion:\n"


@dataclass(frozen=True)
class Tool:
    """One agent-facing tool, as stored: name, signature line, CodeGym text and OpenAI schema."""

    name: str
    signature: str
    text: str
    schema: dict[str, Any]


@dataclass(frozen=True)
class TaskRecord:
    env_id: str
    config_json: str
    difficulty: str = ""
    solve_fc_round: int = 0
    # Success rates of evaluated models, e.g. {"gpt-4o-mini_Bo4_score": 0.25} (`codegym eval`).
    scores: dict[str, float] = field(default_factory=dict, compare=False)
    # The chance a blind Done is right on this config (verification's guessability), None = unmeasured.
    guess_rate: float | None = field(default=None, compare=False)
    # The config exactly as published ("" = `config_json` is that text): what is served and exported.
    config_text: str = field(default="", compare=False)
    # sha256 of the code this task was recorded with when it is not its env's ("" = the env's own).
    source_sha: str = field(default="", compare=False)
    # Published fields kept with the task (extra_info keys, columns this library has no place for).
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def published_config(self) -> str:
        """The config text to serve and export: as published, byte for byte."""
        return self.config_text or self.config_json


@dataclass
class EnvRecord:
    """Everything the runtime needs about an environment, without ever importing it."""

    env_id: str
    code_id: str
    env_class: str
    source: str
    sha256: str
    tools: list[Tool]
    tools_text: str
    task_text: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    tasks: list[TaskRecord] = field(default_factory=list)

    @property
    def tool_names(self) -> list[str]:
        return [t.name for t in self.tools]


@dataclass
class ImportReport:
    """What an import did, item by item, so nothing is skipped silently."""

    added: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    tasks_added: int = 0
    tasks_present: int = 0
    skipped: list[tuple[str, str]] = field(default_factory=list)

    def merge(self, other: ImportReport) -> None:
        self.added += other.added
        self.updated += other.updated
        self.unchanged += other.unchanged
        self.tasks_added += other.tasks_added
        self.tasks_present += other.tasks_present
        self.skipped += other.skipped


def canonical_config(config: dict[str, Any]) -> str:
    """One spelling per config, so re-importing the same task is a no-op.

    Key order is kept: an environment may show its config, and what it shows must not change.
    """
    return json.dumps(config, ensure_ascii=False)


def task_text_from_prompt(prompt: list[dict[str, Any]]) -> str:
    """The task statement of a training instance: the user message after its `Question:` line."""
    for message in prompt:
        if message.get("role") == "user":
            content = str(message.get("content", ""))
            _, sep, question = content.partition(QUESTION_MARKER)
            return (question if sep else content).strip()
    return ""
