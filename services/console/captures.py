"""The Episodes page's reads: captured episodes (`ListEpisodes`, `GetEpisode`), which the runtime
shows a trainer for its own tenant only and an operator for every tenant."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlencode

import grpc

from codegym_client.api.runtime.v1 import runtime_service_pb2 as rt
from codegym_client.async_client import AsyncRuntimeClient


@dataclass(frozen=True)
class Query:
    run_id: str = ""
    env_id: str = ""
    rewarded: str = ""  # "", "yes", "no"
    flagged: bool = False
    errors: bool = False
    page_token: str = ""
    page_size: int = 50

    @classmethod
    def from_params(cls, params: Mapping[str, str], page_size: int) -> Query:
        rewarded = params.get("rewarded", "")
        return cls(
            run_id=params.get("run", "").strip()[:200],
            env_id=params.get("env", "").strip()[:300],
            rewarded=rewarded if rewarded in ("yes", "no") else "",
            flagged=params.get("flagged", "") == "on",
            errors=params.get("errors", "") == "on",
            page_token=params.get("page", "")[:200],
            page_size=page_size,
        )

    def link(self, page_token: str) -> str:
        pairs = [("run", self.run_id), ("env", self.env_id), ("rewarded", self.rewarded)]
        pairs += [("flagged", "on" if self.flagged else ""), ("errors", "on" if self.errors else "")]
        pairs.append(("page", page_token))
        return "?" + urlencode([(k, v) for k, v in pairs if v])


@dataclass
class Listed:
    episodes: list[rt.EpisodeSummary]
    next_page_token: str
    available: bool


async def list_episodes(client: AsyncRuntimeClient, query: Query) -> Listed:
    request = rt.ListEpisodesRequest(
        run_id=query.run_id,
        env_id=query.env_id,
        flagged_only=query.flagged,
        errors_only=query.errors,
        page_size=query.page_size,
        page_token=query.page_token,
    )
    if query.rewarded:
        request.rewarded = query.rewarded == "yes"
    try:
        page = await client.stub.ListEpisodes(request, timeout=client.timeout_s)
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
            raise
        return Listed([], "", False)
    return Listed(list(page.episodes), page.next_page_token, True)


async def get_episode(client: AsyncRuntimeClient, episode_id: str) -> rt.GetEpisodeResponse:
    answer: rt.GetEpisodeResponse = await client.stub.GetEpisode(
        rt.GetEpisodeRequest(episode_id=episode_id), timeout=client.timeout_s
    )
    return answer
