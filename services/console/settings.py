"""The console's settings (`ConsoleSettings`), each option declared once (`codegym.server.settings`):
`codegym console` takes them as flags and `codegym up --console-port` builds them. Its access is
the servers' (the same tokens file: people sign in with a trainer's or an operator's token; TLS;
`--insecure`), and `--token` is what it sends the runtime. Standard library only, for `codegym --help`."""

from __future__ import annotations

from dataclasses import dataclass

from codegym.server.settings import Calls, Output, ServerAccess, host, log_level, nested, option, port

CONSOLE_PORT = 8080


@dataclass(frozen=True)
class ConsoleSettings:
    """Everything `codegym console` is told; `services.console.server.serve` takes it."""

    target: str = option(
        "",
        "--target",
        "runtime address HOST:PORT, several comma-separated, or a dns:/// name (the console reads "
        "everything through its API, never a library file, so it may be remote)",
        required=True,
    )
    host: str = host()
    port: int = port(CONSOLE_PORT)
    grafana_url: str = option("", "--grafana-url", "the Grafana dashboard's URL, linked from the Health page")
    page_size: int = option(50, "--page-size", "rows on a page of the library and of the episodes")
    log_level: str = log_level()
    output: Output = nested(Output)
    access: ServerAccess = nested(ServerAccess)
    calls: Calls = nested(Calls)
