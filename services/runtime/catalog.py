"""The environments a runtime serves, and how a request names one.

A library loaded once at start: lookups by env id, by env class (CodeGym's env strings name only
the class), the task a CreateSession names (ability string, env string or env id + config), and
the read-only RPC answers (ListEnvs, GetEnv). Nothing here runs environment code.
"""

from __future__ import annotations

import json
from typing import Any

from codegym.contract import EnvStringError, parse_ability, parse_config, parse_env_str
from codegym.errors import Reason, Refusal
from codegym.library import EnvRecord
from codegym_client.api.common.v1 import common_pb2
from codegym_client.api.runtime.v1 import runtime_service_pb2 as rt
from services.runtime.requests import MAX_JSON_DEPTH, shown

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


class Catalog:
    def __init__(self, envs: dict[str, EnvRecord]) -> None:
        self.envs = envs
        self.by_class: dict[str, list[str]] = {}
        for env_id, record in envs.items():
            self.by_class.setdefault(record.env_class, []).append(env_id)
        self.sorted_ids = sorted(envs)

    def __len__(self) -> int:
        return len(self.envs)

    def env(self, env_id: str) -> EnvRecord:
        record = self.envs.get(env_id)
        if record is None:
            raise Refusal(
                Reason.ENV_NOT_FOUND,
                f"environment {shown(env_id)} is not in the library ({len(self.envs)} environments; see ListEnvs)",
            )
        return record

    def env_by_class(self, env_class: str) -> EnvRecord:
        ids = self.by_class.get(env_class, [])
        if len(ids) > 1:
            raise Refusal(
                Reason.INVALID_REQUEST,
                f"{env_class} is ambiguous ({', '.join(ids[:5])}); give env_id as {{code_id}}__{env_class}",
            )
        if not ids:
            raise Refusal(Reason.ENV_NOT_FOUND, f"no environment class {shown(env_class)} in the library")
        return self.envs[ids[0]]

    def resolve(self, request: rt.CreateSessionRequest) -> tuple[EnvRecord, dict[str, Any]]:
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
        ids = [i for i in self.sorted_ids if i.startswith(request.prefix) and i > request.page_token]
        page = ids[:size]
        return rt.ListEnvsResponse(
            envs=[
                rt.EnvSummary(
                    env_id=i, tool_names=self.envs[i].tool_names, task_count=len(self.envs[i].tasks)
                )
                for i in page
            ],
            next_page_token=page[-1] if len(ids) > size else "",
        )

    def get_env(self, env_id: str) -> rt.GetEnvResponse:
        record = self.env(env_id)
        return rt.GetEnvResponse(
            env_id=record.env_id,
            tools=tool_specs(record),
            tools_text=record.tools_text,
            task_text=record.task_text,
            tasks=[
                common_pb2.TaskConfig(
                    env_id=t.env_id,
                    config_json=t.config_json,
                    difficulty=DIFFICULTY.get(t.difficulty, common_pb2.DIFFICULTY_UNSPECIFIED),
                    solve_fc_round=t.solve_fc_round,
                )
                for t in record.tasks
            ],
        )
