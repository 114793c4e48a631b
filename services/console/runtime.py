"""The console's calls to the runtime, made for the person signed in.

A trainer's calls go on the console's own token (`CODEGYM_TOKEN`: the service token under `codegym
up --auth` and in k8s), as the OpenEnv gateway's do, and name the trainer's tenant (`codegym-tenant`
metadata, which the runtime honours from service and operator tokens only), so the runtime's
quotas, session ownership and capture visibility are the trainer's. An operator's calls go on the
operator's own token (`Clients`), since the runtime takes what only operators may do from an
operator's token alone.

The tenant travels as the gateway's does (`services.fronting.playing_for`).
"""

from __future__ import annotations

from collections import OrderedDict

from codegym_client.async_client import AsyncRuntimeClient
from services.fronting import ForwardTenant, ForwardTenantStream, playing_for

__all__ = ["Clients", "ForwardTenantStream", "connect", "playing_for"]


def connect(target: str, timeout_s: float = 30.0, token: str | None = None) -> AsyncRuntimeClient:
    """A runtime client whose calls name the tenant of `playing_for`; make it in the event loop.
    `token`: the calls' token (None: the console's own, `CODEGYM_TOKEN`)."""
    return AsyncRuntimeClient(
        target, timeout_s=timeout_s, token=token, interceptors=[ForwardTenant(), ForwardTenantStream()]
    )


# Operators signed in at once whose channels are kept open; the least recently used is closed first.
MAX_OPERATOR_CLIENTS = 16


class Clients:
    """The console's runtime clients: its own (made at startup) and one per operator token in use,
    bounded (`MAX_OPERATOR_CLIENTS`); all made and closed in the event loop."""

    def __init__(self, target: str, timeout_s: float) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self.own = connect(target, timeout_s)
        self._operators: OrderedDict[str, AsyncRuntimeClient] = OrderedDict()

    async def client(self, token: str) -> AsyncRuntimeClient:
        """The client for calls on `token` ("" = the console's own)."""
        if not token:
            return self.own
        found = self._operators.pop(token, None) or connect(self.target, self.timeout_s, token)
        self._operators[token] = found
        while len(self._operators) > MAX_OPERATOR_CLIENTS:
            _, oldest = self._operators.popitem(last=False)
            await oldest.close()
        return found

    async def close(self) -> None:
        for client in [self.own, *self._operators.values()]:
            await client.close()
        self._operators.clear()
