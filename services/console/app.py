"""The console's routes: sign-in, the four pages (Library, Play, Episodes, Curriculum) and Health.

Every page is rendered on the server from the runtime's API (`runtime.py`), for the person signed
in (`access.py`): a trainer's calls name its tenant, so the runtime shows it its own sessions and
captures only; an operator sees every tenant and may change things (lift a quarantine) and read
environment code. Every POST carries the login's CSRF token. Templates autoescape: observations,
actions, configs and code are untrusted text and are shown as text.

The probes (`/live`, `/ready`) answer without a login: Kubernetes sends none.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import grpc
import jinja2
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from codegym_client.errors import (
    CodeGymError,
    EnvNotFound,
    PermissionDenied,
    RuntimeUnavailable,
    SessionNotFound,
    Unauthenticated,
)
from services.console import pages
from services.console.access import COOKIE, Login, LoginRefused, Logins, csrf_ok
from services.console.config import ConsoleConfig
from services.console.pages import NotAllowed
from services.console.plays import Plays
from services.console.runtime import Clients, playing_for

log = logging.getLogger("codegym.console")
TEMPLATES = Path(__file__).parent / "templates"
STATIC = Path(__file__).parent / "static"
Handler = Callable[["Console", Request, Login], Awaitable[Response]]


class Console:
    """The app, its runtime client (made at startup, in the event loop), logins and transcripts."""

    def __init__(self, config: ConsoleConfig) -> None:
        self.config = config
        self.logins = Logins(config.tokens)
        self.plays = Plays()
        self._clients: Clients | None = None  # made at startup, in the event loop
        self.templates = jinja2.Environment(
            loader=jinja2.FileSystemLoader(TEMPLATES),
            autoescape=True,  # every template: what is shown is untrusted text
            undefined=jinja2.StrictUndefined,
        )
        guarded = [
            ("/", pages.home, ["GET"]),
            ("/library", pages.library, ["GET"]),
            ("/env/{env_id:path}", pages.env_page, ["GET"]),
            ("/play", pages.play_start, ["GET", "POST"]),
            ("/play/{session_id}", pages.play_page, ["GET"]),
            ("/play/{session_id}/step", pages.play_step, ["POST"]),
            ("/play/{session_id}/fork", pages.play_fork, ["POST"]),
            ("/play/{session_id}/close", pages.play_close, ["POST"]),
            ("/episodes", pages.episodes, ["GET"]),
            ("/episodes/{episode_id}", pages.episode_page, ["GET"]),
            ("/curriculum", pages.curriculum, ["GET"]),
            ("/health", pages.health, ["GET"]),
            ("/health/lift", pages.lift, ["POST"]),
        ]
        self.app = Starlette(
            routes=[
                Route("/live", self.live),
                Route("/ready", self.ready),
                Route("/login", self.login, methods=["GET", "POST"]),
                Route("/logout", self.logout, methods=["POST"]),
                Mount("/static", StaticFiles(directory=STATIC), name="static"),
                *(Route(path, self.guard(handler), methods=methods) for path, handler, methods in guarded),
            ],
            lifespan=self._lifespan,
        )

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        config = self.config
        self._clients = Clients(config.runtime, config.runtime_timeout_s, config.access, config.tls_ca)
        try:
            yield
        finally:
            await self._clients.close()

    @property
    def clients(self) -> Clients:
        assert self._clients is not None, "the console's clients are made at startup"
        return self._clients

    # rendering -------------------------------------------------------------------------------

    def render(
        self, request: Request, name: str, login: Login | None, status: int = 200, **context: Any
    ) -> HTMLResponse:
        template = self.templates.get_template(name)
        body = template.render(
            login=login,
            page=name.removesuffix(".html"),
            signin=self.logins.required,
            grafana_url=self.config.grafana_url,
            path=request.url.path,
            **context,
        )
        return HTMLResponse(body, status_code=status, headers=SECURITY_HEADERS)

    def error(self, request: Request, login: Login | None, status: int, message: str) -> HTMLResponse:
        return self.render(request, "error.html", login, status=status, message=message)

    # access ----------------------------------------------------------------------------------

    def cookie_login(self, request: Request) -> tuple[str, Login | None]:
        login_id = request.cookies.get(COOKIE, "")
        return login_id, self.logins.find(login_id)

    def set_cookie(self, response: Response, login_id: str) -> None:
        response.set_cookie(
            COOKIE, login_id, httponly=True, samesite="strict", secure=self.config.tls, path="/"
        )

    def guard(self, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        """The route behind a login (with tokens off, an anonymous one made on the first visit), a
        CSRF check on POST, and the runtime's answers turned into pages that say what went wrong."""

        async def route(request: Request) -> Response:
            _, login = self.cookie_login(request)
            fresh = ""
            if login is None:
                if self.logins.required:
                    if request.method != "GET":
                        return self.error(request, None, 401, "sign in first")
                    return RedirectResponse(f"/login?next={request.url.path}", status_code=303)
                fresh, login = self.logins.sign_in("")
            if request.method == "POST":
                form = await request.form()
                if not csrf_ok(login, str(form.get("csrf", ""))):
                    return self.error(
                        request, login, 403, "this form's CSRF token is missing or stale: reload the page"
                    )
            try:
                request.state.runtime = await self.clients.client(login.token)
                with playing_for(login.tenant):
                    response = await handler(self, request, login)
            except NotAllowed as exc:
                response = self.error(request, login, 403, str(exc))
            except CodeGymError as exc:
                response = self.error(
                    request, login, runtime_status(exc), f"the runtime says: {exc.details()}"
                )
            except grpc.RpcError as exc:  # a raw stub call
                response = self.error(
                    request, login, 502, f"the runtime says: {exc.code().name}: {exc.details()}"
                )
            if fresh:
                self.set_cookie(response, fresh)
            return response

        return route

    async def login(self, request: Request) -> Response:
        nxt = safe_next(request.query_params.get("next", "/library"))
        if not self.logins.required:
            return RedirectResponse(nxt, status_code=303)
        if request.method == "GET":
            return self.render(request, "login.html", None, next=nxt, refused="")
        if not same_origin(request):
            return self.render(
                request,
                "login.html",
                None,
                status=403,
                next=nxt,
                refused="a sign-in from another site's page",
            )
        form = await request.form()
        try:
            login_id, _ = self.logins.sign_in(str(form.get("token", "")))
        except LoginRefused as exc:
            return self.render(request, "login.html", None, status=401, next=nxt, refused=str(exc))
        response = RedirectResponse(safe_next(str(form.get("next", nxt))), status_code=303)
        self.set_cookie(response, login_id)
        return response

    async def logout(self, request: Request) -> Response:
        login_id, login = self.cookie_login(request)
        form = await request.form()
        if login is not None and csrf_ok(login, str(form.get("csrf", ""))):
            self.logins.sign_out(login_id)
        response = RedirectResponse("/login", status_code=303)
        response.delete_cookie(COOKIE, path="/")
        return response

    # probes ----------------------------------------------------------------------------------

    async def live(self, request: Request) -> Response:
        return PlainTextResponse("ok")

    async def ready(self, request: Request) -> Response:
        """Ready when the runtime answers (a console without one shows only errors)."""
        try:
            await self.clients.own.wait_ready(timeout_s=2.0)
        except RuntimeUnavailable as exc:
            return PlainTextResponse(f"runtime unavailable: {exc.details()}", status_code=503)
        return PlainTextResponse("ok")


# Pages are never framed (clickjacking), never sniffed, and run no script but the console's own.
SECURITY_HEADERS = {
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; "
    "img-src 'self' data:; frame-ancestors 'none'; form-action 'self'",
}


def runtime_status(exc: CodeGymError) -> int:
    """The HTTP status a page shows for a runtime error."""
    if isinstance(exc, (EnvNotFound, SessionNotFound)):
        return 404
    if isinstance(exc, (PermissionDenied, Unauthenticated)):
        return 403
    if isinstance(exc, RuntimeUnavailable):
        return 503
    return 400


def safe_next(path: str) -> str:
    """A redirect target inside this console only (no `//host`, no scheme)."""
    if not path.startswith("/") or path.startswith("//") or "\\" in path:
        return "/library"
    return path


def same_origin(request: Request) -> bool:
    """Whether a POST comes from this console's own pages, as far as the browser says (`Origin`).
    The login form carries no CSRF token (there is no login yet to hold one), so a page of another
    site could sign a visitor's browser into that site's own token (login CSRF); a browser names
    the posting page's origin, and one naming another host is refused. A request naming none (a
    script, an old browser) is not a cross-site form post of a modern browser and passes."""
    origin = request.headers.get("origin")
    if origin is None:
        return True
    return urlsplit(origin).netloc == request.headers.get("host", "")
