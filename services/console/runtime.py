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
from codegym_client.channels import Access
from services.fronting import ForwardTenant, ForwardTenantStream, playing_for

__all__ = ["Clients", "ForwardTenantStream", "connect", "playing_for"]


def connect(target: str, timeout_s: float = 30.0, access: Access | None = None) -> AsyncRuntimeClient:
    """A runtime client whose calls name the tenant of `playing_for`; make it in the event loop.
    `access`: the calls' token and CA (None: from the environment)."""
    return AsyncRuntimeClient(
        target, timeout_s=timeout_s, access=access, interceptors=[ForwardTenant(), ForwardTenantStream()]
    )


# Operators signed in at once whose channels are kept open; the least recently used is closed first.
MAX_OPERATOR_CLIENTS = 16


class Clients:
    """The console's runtime clients: its own (made at startup) and one per operator token in use,
    bounded (`MAX_OPERATOR_CLIENTS`); all made and closed in the event loop."""

    def __init__(self, target: str, timeout_s: float, access: Access | None = None, tls_ca: str = "") -> None:
        self.target = target
        self.timeout_s = timeout_s
        self.tls_ca = tls_ca
        self.own = connect(target, timeout_s, access)
        self._operators: OrderedDict[str, AsyncRuntimeClient] = OrderedDict()

    async def client(self, token: str) -> AsyncRuntimeClient:
        """The client for calls on `token` ("" = the console's own)."""
        if not token:
            return self.own
        found = self._operators.pop(token, None) or connect(
            self.target, self.timeout_s, Access.from_values(token, self.tls_ca)
        )
        self._operators[token] = found
        while len(self._operators) > MAX_OPERATOR_CLIENTS:
            _, oldest = self._operators.popitem(last=False)
            await oldest.close()
        return found

    async def close(self) -> None:
        for client in [self.own, *self._operators.values()]:
            await client.close()
        self._operators.clear()
