"""What the environment library holds, as plain records: environments, their tools and task configs.

Kept apart from the SQLite store (library.py) and from importing (library_import.py): the runtime,
the pipeline, export and eval all read these.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from codegym_client.abilities import make_ability

DIFFICULTIES = ("", "easy", "medium", "hard")
# Learnability labels from the runtime's record of served episodes (`codegym library label`), apart
# from the published easy/medium/hard `difficulty`; "" = not labelled.
LEARNABILITY = ("unsolved", "learnable", "mastered")
# What an import does with an environment key whose code differs from the library's.
ON_CONFLICT = ("refuse", "keep", "replace")
# How a training instance shows its tools: CodeGym's prompt, OpenAI tool schemas, or both.
TOOL_MODES = ("text", "json", "both")
# Where the task statement starts in a training instance's user message (English, Chinese protocol).
QUESTION_MARKERS = ("\nQuestion:\n", "\n问题：\n")


def learnability_labels(text: str) -> frozenset[str]:
    """`--learnability unsolved,learnable`: the labels kept (`codegym library label` writes them)."""
    labels = frozenset(label.strip() for label in text.split(",") if label.strip())
    unknown = sorted(labels - set(LEARNABILITY))
    if unknown or not labels:
        raise ValueError(f"learnability labels are {', '.join(LEARNABILITY)}, not {text!r}")
    return labels


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
    # How a run fared on it, one of LEARNABILITY ("" = not labelled): `codegym library label`.
    learnability: str = field(default="", compare=False)

    @property
    def published_config(self) -> str:
        """The config text to serve and export: as published, byte for byte."""
        return self.config_text or self.config_json

    @property
    def ability(self) -> str:
        """The training ability string `codegym_v1@{env_id}@{config}`, the config as published."""
        return make_ability(self.env_id, self.published_config)


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


# Examples kept per skip reason and source: the counts are complete, the examples a sample.
EXAMPLES_PER_REASON = 5


@dataclass
class Skips:
    """Rows skipped for one reason: how many, and a few of them (where, what exactly)."""

    count: int = 0
    examples: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class SourceReport:
    """What one source of an import brought: a file, or a folder of Parquet shards or env files.

    Every row read is counted once: an environment row ends added, updated, unchanged, a duplicate
    (the same key and code as a row read earlier in this import, from `env_duplicates`' source),
    a conflict left unwritten, or skipped; a task row ends added, present (in the library before),
    a duplicate (the same config of the same environment earlier in this import), or skipped. So
    rows read minus skips, duplicates and conflicts is what this source holds in the library.
    """

    name: str
    kind: str
    rows: int = 0
    envs_added: int = 0
    envs_updated: int = 0
    envs_unchanged: int = 0
    env_duplicates: dict[str, int] = field(default_factory=dict)
    conflicts: int = 0
    tasks_added: int = 0
    tasks_present: int = 0
    task_duplicates: int = 0
    # Task rows recorded with code other than their environment's (each task keeps its own, a variant).
    other_code: int = 0
    trajectories: int = 0
    skipped: dict[str, Skips] = field(default_factory=dict)

    def skip(self, reason: str, where: str, detail: str = "") -> None:
        skips = self.skipped.setdefault(reason, Skips())
        skips.count += 1
        if len(skips.examples) < EXAMPLES_PER_REASON:
            skips.examples.append((where, detail))

    @property
    def skipped_rows(self) -> int:
        return sum(s.count for s in self.skipped.values())

    def as_dict(self) -> dict[str, Any]:
        return {
            "source": self.name,
            "kind": self.kind,
            "rows": self.rows,
            "envs": {
                "added": self.envs_added,
                "updated": self.envs_updated,
                "unchanged": self.envs_unchanged,
                "duplicates": dict(self.env_duplicates),
                "conflicts": self.conflicts,
            },
            "tasks": {
                "added": self.tasks_added,
                "present": self.tasks_present,
                "duplicates": self.task_duplicates,
                "other_code": self.other_code,
                "trajectories": self.trajectories,
            },
            "skipped": {
                reason: {"count": s.count, "examples": [list(e) for e in s.examples]}
                for reason, s in self.skipped.items()
            },
        }


@dataclass(frozen=True)
class Conflict:
    """An environment key met with code other than the library's: never overwritten silently."""

    env_id: str
    file: str  # where the row with the new code was read
    other: str  # where the library's code came from (its `metadata["file"]`)
    resolution: str  # "refused" (the default), "kept" or "replaced" (`--on-conflict`)


@dataclass
class ImportReport:
    """What an import did, source by source, so nothing is skipped silently."""

    sources: list[SourceReport] = field(default_factory=list)
    added: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    conflicts: list[Conflict] = field(default_factory=list)

    def source(self, name: str, kind: str) -> SourceReport:
        """The report of source `name`, started when first asked for."""
        for source in self.sources:
            if source.name == name:
                return source
        self.sources.append(SourceReport(name, kind))
        return self.sources[-1]

    @property
    def tasks_added(self) -> int:
        return sum(s.tasks_added for s in self.sources)

    @property
    def tasks_present(self) -> int:
        return sum(s.tasks_present for s in self.sources)

    @property
    def skipped_count(self) -> int:
        return sum(s.skipped_rows for s in self.sources)

    @property
    def skipped(self) -> list[tuple[str, str]]:
        """(where, why) of the skipped rows: all of them for a small import, a few per reason and
        source beyond `EXAMPLES_PER_REASON` (`skipped_count` counts them all)."""
        return [
            (where, f"{reason}: {detail}" if detail else reason)
            for source in self.sources
            for reason, skips in source.skipped.items()
            for where, detail in skips.examples
        ]

    @property
    def refused(self) -> list[Conflict]:
        return [c for c in self.conflicts if c.resolution == "refused"]

    def merge(self, other: ImportReport) -> None:
        """Add another import's report to this one (sources of the same name are kept apart)."""
        self.sources += other.sources
        self.added += other.added
        self.updated += other.updated
        self.unchanged += other.unchanged
        self.conflicts += other.conflicts

    def as_dict(self) -> dict[str, Any]:
        return {
            "sources": [s.as_dict() for s in self.sources],
            "envs": {
                "added": len(self.added),
                "updated": len(self.updated),
                "unchanged": len(self.unchanged),
            },
            "tasks": {"added": self.tasks_added, "present": self.tasks_present},
            "skipped": self.skipped_count,
            "conflicts": [
                {"env_id": c.env_id, "file": c.file, "other": c.other, "resolution": c.resolution}
                for c in self.conflicts
            ],
        }


def canonical_config(config: dict[str, Any]) -> str:
    """One spelling per config, so re-importing the same task is a no-op.

    Key order is kept: an environment may show its config, and what it shows must not change.
    """
    return json.dumps(config, ensure_ascii=False)


def task_text_from_prompt(prompt: list[dict[str, Any]]) -> str:
    """The task statement of a training instance: the user message after its `Question:` line
    (`问题：` in the Chinese protocol); the whole message when it has neither."""
    for message in prompt:
        if isinstance(message, dict) and message.get("role") == "user":
            content = str(message.get("content", ""))
            for marker in QUESTION_MARKERS:
                _, sep, question = content.partition(marker)
                if sep:
                    return question.strip()
            return content.strip()
    return ""
