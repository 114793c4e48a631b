"""The environments a runtime serves, and how a request names one.

The library is read where it lies (its SQLite file), one environment at a time: CodeGym's published
library is 20,000+ environments, and a runtime that held all of them would pay for every one in
memory and in every garbage collection, while a trainer's batch uses a few hundred at once. The
records in play are kept in a cache bounded in bytes (`--env-cache-mb`); a miss is one indexed read.
Lookups by env id, by env class (CodeGym's env strings name only the class), the task a
CreateSession names (ability string, env string or env id + config), the code a session was
created with (a task may have been recorded with other code than its environment's), and the
read-only RPC answers (ListEnvs, GetEnv) paged through the file. Nothing here runs environment code.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, NamedTuple

from codegym.bounded_cache import BoundedCache
from codegym.contract import EnvStringError, parse_ability, parse_config, parse_env_str
from codegym.errors import Reason, Refusal
from codegym.library import search
from codegym.library.store import EnvRecord, Library, canonical_config
from codegym_client.api.common.v1 import common_pb2
from codegym_client.api.runtime.v1 import runtime_service_pb2 as rt
from services.runtime.requests import MAX_JSON_DEPTH, shown
from services.runtime.settings import ENV_CACHE_MB

DIFFICULTY = {
    "easy": common_pb2.DIFFICULTY_EASY,
    "medium": common_pb2.DIFFICULTY_MEDIUM,
    "hard": common_pb2.DIFFICULTY_HARD,
}


def tool_specs(record: EnvRecord) -> list[common_pb2.ToolSpec]:
    return [
        common_pb2.ToolSpec(name=t.name, signature=t.signature, text=t.text, json_schema=json.dumps(t.schema))
        for t in record.tools
    ]


class Served(NamedTuple):
    """An environment as sessions use it: the code their operations run, the tool names a step's
    action is checked against, and what a create answers.

    Strings and bytes in a tuple, because the runtime caches thousands of these for as long as
    their episodes play, and a full garbage collection walks every container it holds. A library
    `EnvRecord` is about 35 of them (its tools, their schema dicts and lists): with the 1,800 that
    32 MiB holds of a 13,200-environment library, one collection took 45 ms against 3 ms for the
    runtime alone, and every step in flight waited for it (the runtime paused 60-160 ms at a time
    under 1,024 rollouts). Here only the tuple itself is tracked; the tool specs stay serialized
    until a create answers with them.
    """

    env_id: str
    sha256: str
    source: str
    tool_names: tuple[str, ...]
    tool_specs: tuple[bytes, ...]  # common_pb2.ToolSpec, serialized
    tools_text: str
    task_text: str

    @classmethod
    def of(cls, record: EnvRecord) -> Served:
        return cls(
            env_id=record.env_id,
            sha256=record.sha256,
            source=record.source,
            tool_names=tuple(record.tool_names),
            tool_specs=tuple(spec.SerializeToString() for spec in tool_specs(record)),
            tools_text=record.tools_text,
            task_text=record.task_text,
        )

    def specs(self) -> list[common_pb2.ToolSpec]:
        return [common_pb2.ToolSpec.FromString(spec) for spec in self.tool_specs]

    @property
    def cost(self) -> int:
        """What it holds in memory, about."""
        parts = (self.env_id, self.sha256, self.source, self.tools_text, self.task_text)
        held = sum(sys.getsizeof(part) for part in (*parts, *self.tool_names, *self.tool_specs))
        return held + sys.getsizeof(self) + 256


class Catalog:
    """The library as the runtime reads it: by key, through a byte-bounded cache of records."""

    def __init__(self, library: str | Path, *, cache_bytes: int = ENV_CACHE_MB << 20) -> None:
        if not Path(library).exists():
            raise FileNotFoundError(
                f"library {library} does not exist: build it with 'codegym library import'"
            )
        self.path = Path(library)
        self.library = Library(library, read_only=True)
        # Environments by env id (their own code) and by "sha256:…" (a task's recorded code).
        self.records: BoundedCache[str, Served] = BoundedCache("runtime_envs", cache_bytes)
        self.size = self.library.counts()[0]

    def __len__(self) -> int:
        return self.size

    def close(self) -> None:
        self.library.close()

    def env(self, env_id: str) -> Served:
        served = self.records.get(env_id)
        if served is None:
            record = self.library.get(env_id, tasks=False)
            if record is None:
                raise Refusal(
                    Reason.ENV_NOT_FOUND,
                    f"environment {shown(env_id)} is not in the library ({self.size} environments; see ListEnvs)",
                )
            served = Served.of(record)
            self.records.put(env_id, served, served.cost)
        return served

    def oracle_steps(self, env_id: str, config_json: str) -> int:
        """Steps the oracle needs on a task (`solve_fc_round`), 0 when the library does not say."""
        task = self.library.task(env_id, config_json)
        return task.solve_fc_round if task is not None else 0

    def code(self, env_id: str, sha256: str) -> Served:
        """The environment as a session created with code `sha256` runs it: its own record, or the
        variant its task was recorded with ("" = whatever the library holds for it now)."""
        record = self.env(env_id)
        if not sha256 or record.sha256 == sha256:
            return record
        key = "sha256:" + sha256
        variant = self.records.get(key)
        if variant is None:
            found = self.library.variant(sha256)
            if found is None or found.env_id != env_id:
                raise Refusal(
                    Reason.ENV_NOT_FOUND,
                    f"the code this session of {shown(env_id)} was created with is no longer in the library",
                )
            variant = Served.of(found)
            self.records.put(key, variant, variant.cost)
        return variant

    def env_by_class(self, env_class: str) -> Served:
        ids = self.library.ids_of_class(env_class)
        if len(ids) > 1:
            raise Refusal(
                Reason.INVALID_REQUEST,
                f"{env_class} is ambiguous ({', '.join(ids[:5])}); give env_id as {{code_id}}__{env_class}",
            )
        if not ids:
            raise Refusal(Reason.ENV_NOT_FOUND, f"no environment class {shown(env_class)} in the library")
        return self.env(ids[0])

    def task_code(self, record: Served, config: dict[str, Any]) -> Served:
        """The code a create runs: the one the named task was recorded with, when the library holds
        that task with code of its own (CodeGym's published task rows carry theirs)."""
        try:
            key = canonical_config(config)
        except (TypeError, ValueError):
            return record
        recorded = self.library.task_source(record.env_id, key)
        if not recorded or recorded == record.sha256:
            return record
        return self.code(record.env_id, recorded)

    def resolve(self, request: rt.CreateSessionRequest) -> tuple[Served, dict[str, Any]]:
        """The environment and config the request names; INVALID_ARGUMENT for anything unreadable."""
        which = request.WhichOneof("task")
        try:
            if which == "ability":
                ability = parse_ability(request.ability)
                return self.env(ability.env_id), ability.config
            if which == "env_task":
                task = request.env_task
                if task.env_str:
                    parsed = parse_env_str(task.env_str)
                    if task.env_id and task.env_id not in (parsed.env_class,):
                        if not task.env_id.endswith("__" + parsed.env_class):
                            raise Refusal(
                                Reason.INVALID_REQUEST,
                                f"env string names {parsed.env_class}, which is not env {shown(task.env_id)}",
                            )
                        return self.env(task.env_id), parsed.config
                    return self.env_by_class(parsed.env_class), parsed.config
                if not task.env_id:
                    raise Refusal(Reason.INVALID_REQUEST, "env_task needs env_id (or env_str)")
                return self.env(task.env_id), parse_config(task.config_json or "{}")
        except EnvStringError as exc:
            raise Refusal(Reason.INVALID_REQUEST, f"bad task: {exc}") from None
        except RecursionError:
            raise Refusal(
                Reason.INVALID_REQUEST,
                f"bad task: config is nested deeper than {MAX_JSON_DEPTH} levels",
            ) from None
        except (ValueError, TypeError, MemoryError) as exc:  # e.g. an integer of more than 4300 digits
            reason = str(exc).split("; use sys.", 1)[0]
            raise Refusal(Reason.INVALID_REQUEST, f"bad task: config cannot be read: {reason}") from None
        raise Refusal(Reason.INVALID_REQUEST, "name the task with ability or env_task")

    def list_envs(self, request: rt.ListEnvsRequest) -> rt.ListEnvsResponse:
        size = min(request.page_size or 100, 1000)
        rows = self.library.page(request.prefix, request.page_token, size + 1)
        page = rows[:size]
        return rt.ListEnvsResponse(
            envs=[rt.EnvSummary(env_id=i, tool_names=tools, task_count=n) for i, tools, n in page],
            next_page_token=page[-1][0] if len(rows) > size else "",
        )

    def search(self, request: rt.SearchEnvsRequest) -> rt.SearchEnvsResponse:
        """A page of SearchEnvs (the library's search index, search.py); `quarantined` unset."""
        if request.page_size > search.MAX_PAGE:
            raise Refusal(Reason.INVALID_REQUEST, f"page_size {request.page_size} exceeds {search.MAX_PAGE}")
        labels = list(request.learnability)
        unknown = [label for label in labels if label not in search.LABELS]
        if unknown:
            raise Refusal(
                Reason.INVALID_REQUEST,
                f"learnability {shown(unknown[0])} is not one of {', '.join(search.LABELS)}",
            )
        low = request.min_pass_rate if request.HasField("min_pass_rate") else None
        high = request.max_pass_rate if request.HasField("max_pass_rate") else None
        for name, value in (("min_pass_rate", low), ("max_pass_rate", high)):
            if value is not None and not 0.0 <= value <= 1.0:
                raise Refusal(Reason.INVALID_REQUEST, f"{name} {value} is not within 0..1")
        if len(request.text) > search.MAX_TEXT:
            raise Refusal(Reason.INVALID_REQUEST, f"text is longer than {search.MAX_TEXT} characters")
        try:
            query = search.Query(
                text=request.text,
                source=request.source,
                labels=labels,
                min_rate=low,
                max_rate=high,
                size=request.page_size or search.DEFAULT_PAGE,
                after=search.read_token(request.page_token),
            )
            hits, token, total = self.library.search(query)
        except search.BadQuery as exc:
            raise Refusal(Reason.INVALID_REQUEST, str(exc)) from None
        return rt.SearchEnvsResponse(
            envs=[
                rt.EnvSearchHit(
                    env_id=hit.env_id,
                    name=hit.name,
                    description=hit.description,
                    source=hit.source,
                    task_count=hit.task_count,
                    learnability=hit.labels,
                    bo4_pass_rate=hit.bo4,
                    bo8_pass_rate=hit.bo8,
                )
                for hit in hits
            ],
            next_page_token=token,
            total=min(total, search.COUNT_CAP),
            total_capped=total > search.COUNT_CAP,
        )

    def get_env(self, env_id: str) -> rt.GetEnvResponse:
        record = self.library.get(env_id)
        if record is None:
            self.env(env_id)  # ENV_NOT_FOUND, as any other lookup says it
            raise AssertionError("unreachable")
        return rt.GetEnvResponse(
            env_id=record.env_id,
            tools=tool_specs(record),
            tools_text=record.tools_text,
            task_text=record.task_text,
            tasks=[
                common_pb2.TaskConfig(
                    env_id=t.env_id,
                    config_json=t.published_config,
                    difficulty=DIFFICULTY.get(t.difficulty, common_pb2.DIFFICULTY_UNSPECIFIED),
                    solve_fc_round=t.solve_fc_round,
                )
                for t in record.tasks
            ],
        )
