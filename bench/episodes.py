"""Episodes as the benches play them, one transport each: a session of the runtime's gRPC API
(`GrpcEpisode`, as the trainer adapters open them) or a WebSocket of the OpenEnv gateway
(`WsEpisode`, as OpenEnv's EnvClient opens them). Same calls (`EpisodeTransport`), so one load generator
(bench/load.py) and one soak (bench/soak.py) drive either.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any, Protocol

from bench.common import Line
from codegym_client.abilities import make_ability
from codegym_client.async_client import AsyncRuntimeClient
from codegym_client.errors import CapacityExceeded

DEFAULT_RETRY_S = 0.05  # a refusal that came without a retry-after hint


class Refused(Exception):
    """The server said "not now" (CAPACITY): send the same call again after `delay_s`."""

    def __init__(self, delay_s: float | None) -> None:
        super().__init__("capacity")
        self.delay_s = delay_s or DEFAULT_RETRY_S


class Failed(Exception):
    """The server refused for good (an OpenEnv error frame): the episode ends."""


class EpisodeTransport(Protocol):
    """One episode on one transport; `create` and `step` raise Refused to be sent again."""

    async def create(self, line: Line) -> None: ...
    async def step(self, action: str) -> str: ...
    async def close(self) -> None: ...


class GrpcEpisode:
    """A session through the runtime's gRPC API (AsyncRuntimeClient), as the trainer adapters open them."""

    def __init__(self, client: AsyncRuntimeClient) -> None:
        self.client = client
        self.session_id = ""

    async def create(self, line: Line) -> None:
        try:
            created = await self.client.create_session(env_id=line["env_id"], config=line["config"])
        except CapacityExceeded as exc:
            raise Refused(exc.retry_after_s) from None
        self.session_id = created.session_id

    async def step(self, action: str) -> str:
        try:
            response = await self.client.step(self.session_id, action)
        except CapacityExceeded as exc:
            raise Refused(exc.retry_after_s) from None
        observation: str = response.observation
        return observation

    async def close(self) -> None:
        if self.session_id:
            with contextlib.suppress(Exception):
                await self.client.close_session(self.session_id)
            self.session_id = ""


class WsEpisode:
    """An episode as OpenEnv's EnvClient plays it: its own WebSocket (connect options as EnvClient's
    defaults, and its `Authorization: Bearer` header when given an access `token`), `reset` naming
    the task, `call_tool` steps, `close`."""

    def __init__(self, url: str, token: str = "") -> None:
        self.url = url
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.ws: Any = None

    async def create(self, line: Line) -> None:
        if self.ws is None:
            from websockets.asyncio.client import connect

            self.ws = await connect(
                self.url,
                open_timeout=30,
                max_size=None,
                ping_interval=20,
                ping_timeout=20,
                additional_headers=self.headers,
            )
        ability = make_ability(line["env_id"], line["config"])
        await self._ask("reset", {"ability": ability})

    async def step(self, action: str) -> str:
        parsed = json.loads(action)
        call = {"type": "call_tool", "tool_name": parsed["name"], "arguments": parsed["parameters"]}
        data = await self._ask("step", call)
        result: str = data["observation"]["result"]
        return result

    async def _ask(self, kind: str, data: dict[str, Any]) -> dict[str, Any]:
        await self.ws.send(json.dumps({"type": kind, "data": data}))
        answer = json.loads(await self.ws.recv())
        if answer.get("type") == "error":
            error = answer.get("data") or {}
            if error.get("code") == "CAPACITY_REACHED":
                raise Refused(None)
            raise Failed(f"{error.get('code')}: {error.get('message')}")
        reply: dict[str, Any] = answer["data"]
        return reply

    async def close(self) -> None:
        if self.ws is not None:
            with contextlib.suppress(Exception):
                await self.ws.send(json.dumps({"type": "close"}))
                await self.ws.close()
            self.ws = None
