"""The console's settings (`codegym console`'s flags)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from codegym.server.auth import Identity


@dataclass(frozen=True)
class ConsoleConfig:
    # The runtime: HOST:PORT, several comma-separated, or a dns:/// name.
    runtime: str
    # Access tokens people sign in with (the servers' tokens file); empty: no sign-in.
    tokens: Mapping[str, Identity] = field(default_factory=dict)
    # Serving HTTPS: the login cookie is then `Secure`.
    tls: bool = False
    # Where the Grafana dashboard (k8s/grafana/codegym-dashboard.json) is served; "" = not linked.
    grafana_url: str = ""
    # One runtime call's deadline.
    runtime_timeout_s: float = 30.0
    # Rows on a page of the library and of the episodes.
    page_size: int = 50
    # How the console calls the runtime (`codegym_client.channels.Access`: its token and CA; None:
    # from the environment), and the CA an operator's own calls check the runtime against.
    access: Any = None
    tls_ca: str = ""
