"""The Library page's reads: a page of environments matching a search, and one environment with
its tasks' published scores, its record and its health, all from the runtime's API.

Search is the runtime's `SearchEnvs` (text, source, learnability, published pass-rate range,
paged on the server); a runtime that predates it is searched by id prefix (`ListEnvs`)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field

import grpc

from codegym.library.search import LABELS
from codegym_client.api.common.v1 import common_pb2 as common
from codegym_client.api.runtime.v1 import runtime_service_pb2 as rt
from codegym_client.async_client import AsyncRuntimeClient
from services.console.plays import clip

# The library's learnability labels of a task (`codegym library label`), as SearchEnvs filters them.
LEARNABILITY = LABELS


def fraction(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if 0.0 <= value <= 1.0 else None


@dataclass(frozen=True)
class Query:
    text: str = ""
    source: str = ""
    learnability: tuple[str, ...] = ()
    min_pass_rate: float | None = None
    max_pass_rate: float | None = None
    page_token: str = ""
    page_size: int = 50

    @classmethod
    def from_params(cls, params: Mapping[str, str], page_size: int) -> Query:
        getlist = getattr(params, "getlist", None)
        chosen = getlist("learnability") if getlist else []
        return cls(
            text=params.get("q", "").strip()[:200],
            source=params.get("source", "").strip()[:100],
            learnability=tuple(x for x in chosen if x in LEARNABILITY),
            min_pass_rate=fraction(params.get("min", "")),
            max_pass_rate=fraction(params.get("max", "")),
            page_token=params.get("page", "")[:200],
            page_size=page_size,
        )

    def link(self, page_token: str) -> str:
        """The query string of this search's page at `page_token`."""
        from urllib.parse import urlencode

        pairs: list[tuple[str, str]] = [("q", self.text), ("source", self.source)]
        pairs += [("learnability", x) for x in self.learnability]
        if self.min_pass_rate is not None:
            pairs.append(("min", str(self.min_pass_rate)))
        if self.max_pass_rate is not None:
            pairs.append(("max", str(self.max_pass_rate)))
        pairs.append(("page", page_token))
        return "?" + urlencode([(k, v) for k, v in pairs if v])


@dataclass
class Row:
    env_id: str
    about: str  # the description (SearchEnvs) or the tool names (ListEnvs)
    task_count: int
    source: str = ""
    learnability: dict[str, int] = field(default_factory=dict)
    bo4: float | None = None
    bo8: float | None = None
    quarantined: bool = False


@dataclass
class Found:
    rows: list[Row]
    next_page_token: str
    total: int | None
    searched: bool  # by the runtime's SearchEnvs (else: an id prefix)


async def search(client: AsyncRuntimeClient, query: Query) -> Found:
    """A page of the runtime's SearchEnvs; a runtime that predates it (UNIMPLEMENTED) is searched
    by env id prefix with ListEnvs."""
    request = rt.SearchEnvsRequest(
        text=query.text,
        source=query.source,
        learnability=list(query.learnability),
        page_size=query.page_size,
        page_token=query.page_token,
    )
    if query.min_pass_rate is not None:
        request.min_pass_rate = query.min_pass_rate
    if query.max_pass_rate is not None:
        request.max_pass_rate = query.max_pass_rate
    try:
        page = await client.stub.SearchEnvs(request, timeout=client.timeout_s)
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
            raise
    else:
        return Found([row_of(hit) for hit in page.envs], page.next_page_token, page.total, True)
    listed = await client.stub.ListEnvs(
        rt.ListEnvsRequest(prefix=query.text, page_size=query.page_size, page_token=query.page_token),
        timeout=client.timeout_s,
    )
    rows = [Row(env.env_id, ", ".join(env.tool_names), env.task_count) for env in listed.envs]
    return Found(rows, listed.next_page_token, None, False)


def row_of(hit: rt.EnvSearchHit) -> Row:
    return Row(
        hit.env_id,
        hit.description,
        hit.task_count,
        source=hit.source,
        learnability=dict(hit.learnability),
        bo4=hit.bo4_pass_rate if hit.HasField("bo4_pass_rate") else None,
        bo8=hit.bo8_pass_rate if hit.HasField("bo8_pass_rate") else None,
        quarantined=hit.quarantined,
    )


@dataclass
class TaskRow:
    number: int
    config_json: str
    difficulty: str
    oracle_steps: int
    bo4: float | None
    bo8: float | None
    pool: str
    episodes: int
    pass_rate: float


@dataclass
class EnvView:
    env: rt.GetEnvResponse
    tasks: list[TaskRow]
    health: rt.EnvStats | None
    error_rate: float
    summary: Row | None  # its SearchEnvs row: mean published Bo4/Bo8, labels, source


async def summary_of(client: AsyncRuntimeClient, env_id: str) -> Row | None:
    """The environment's own SearchEnvs row (a search by its id), None from a runtime without it."""
    try:
        page = await client.stub.SearchEnvs(
            rt.SearchEnvsRequest(text=env_id, page_size=20), timeout=client.timeout_s
        )
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
            raise
        return None
    return next((row_of(hit) for hit in page.envs if hit.env_id == env_id), None)


async def env_view(client: AsyncRuntimeClient, env_id: str) -> EnvView:
    # Three independent reads, at once: the page waits for the slowest, not for their sum.
    env, stats, summary = await asyncio.gather(
        client.get_env(env_id), client.stats("", env_prefix=env_id), summary_of(client, env_id)
    )
    by_config: dict[str, rt.TaskStats] = {}
    health = None
    for entry in stats:
        if entry.HasField("task") and entry.task.env_id == env_id:
            by_config[entry.task.ability.split("@", 2)[-1]] = entry.task
        elif entry.HasField("env") and entry.env.env_id == env_id:
            health = entry.env
    tasks = []
    for number, task in enumerate(env.tasks):
        record = by_config.get(task.config_json)
        bo4 = record.prior_pass_rate if record is not None and record.HasField("prior_pass_rate") else None
        tasks.append(
            TaskRow(
                number,
                clip(task.config_json),
                common.Difficulty.Name(task.difficulty).removeprefix("DIFFICULTY_").lower(),
                task.solve_fc_round,
                bo4,
                None,
                record.pool if record is not None else "",
                record.episodes if record is not None else 0,
                record.pass_rate if record is not None else 0.0,
            )
        )
    error_rate = (
        sum(health.step_errors.values()) / health.steps if health is not None and health.steps else 0.0
    )
    return EnvView(env, tasks, health, error_rate, summary)


async def env_code(client: AsyncRuntimeClient, env_id: str) -> tuple[str, str]:
    """(code, "") from the runtime's operator-only GetEnvCode, or ("", why not)."""
    try:
        answer = await client.stub.GetEnvCode(rt.GetEnvCodeRequest(env_id=env_id), timeout=client.timeout_s)
    except grpc.RpcError as exc:
        return "", f"{exc.code().name}: {exc.details()}"
    return str(answer.code), ""
