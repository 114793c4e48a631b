"""`codegym console`: the web console (services/console) in front of a runtime, local or remote.

Its access options are the OpenEnv gateway's (`--tokens`, `--tls-cert`/`--tls-key`, `--insecure`;
`--token` is what it sends the runtime): people sign in with a trainer's or an operator's token
from the tokens file; without tokens it binds loopback only unless `--insecure`. Web modules are
imported when the command runs, never for `--help`."""

from __future__ import annotations

import argparse

from codegym_cli.serve_setup import configure_logs, run_server, server_auth


def _console(args: argparse.Namespace) -> int:
    auth = server_auth(args)  # refuses a non-loopback bind without tokens unless --insecure
    from services.console.config import ConsoleConfig
    from services.console.server import serve

    configure_logs(args.log_level, "text")
    tls = (args.tls_cert, args.tls_key) if args.tls_cert else None  # both read above, or refused
    config = ConsoleConfig(
        runtime=args.target,
        tokens=auth.tokens,
        tls=tls is not None,
        grafana_url=args.grafana_url,
        page_size=args.page_size,
    )
    run_server(lambda: serve(config, args.host, args.port, tls))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    console = sub.add_parser(
        "console",
        help="web console: browse the library, play a task by hand, read captured episodes, watch a "
        "run's curriculum and the library's health",
        description="Server-rendered pages in front of a runtime's API (it never reads a library "
        "file, so the runtime may be remote). With access tokens, people sign in with a trainer's "
        "token (its own tenant's data) or an operator's (everything, lifting quarantines, environment "
        "code). See docs/console.md.",
    )
    console.add_argument("--target", required=True, help="runtime address HOST:PORT (or several, or dns:///)")
    console.add_argument("--host", default="127.0.0.1", help="address to bind")
    console.add_argument("--port", type=int, default=8080, help="port (0 = any free port)")
    console.add_argument(
        "--tokens",
        default=None,
        help="access tokens people sign in with (the servers' tokens file; $CODEGYM_TOKENS_FILE when not "
        "given); --token is what the console sends the runtime (a service token: it names each "
        "trainer's tenant on its calls). Without either, no sign-in and loopback only",
    )
    console.add_argument(
        "--tls-cert", default="", help="serve HTTPS with this certificate (PEM; with --tls-key)"
    )
    console.add_argument("--tls-key", default="", help="the TLS certificate's private key (PEM)")
    console.add_argument(
        "--insecure",
        action="store_true",
        help="bind an address other than loopback without access tokens (refused otherwise)",
    )
    console.add_argument("--grafana-url", default="", help="the Grafana dashboard's URL, linked from Health")
    console.add_argument(
        "--page-size", type=int, default=50, help="rows on a page of the library and episodes"
    )
    console.add_argument("--log-level", default="WARNING", help="logging level")
    console.set_defaults(func=_console)
