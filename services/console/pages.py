"""The handlers of the console's pages; each gets the console, the request and the login, and
reads the runtime for that login (`app.Console.guard` names the tenant on every call)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Protocol

from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response

from codegym_client.api.runtime.v1 import runtime_service_pb2 as rt
from codegym_client.async_client import AsyncRuntimeClient
from services.console import library as lib
from services.console import plots
from services.console.curriculum import VERSIONS_LISTED, curriculum_view
from services.console.highlight import highlight
from services.console.plays import CONSOLE_RUN, Play, Turn, clip
from services.console.schemas import BadForm, parameters, tool_form

if TYPE_CHECKING:
    from services.console.access import Login
    from services.console.config import ConsoleConfig
    from services.console.plays import Plays


# Environments the Health page lists by error rate (beside every quarantined one).
ERRORS_SHOWN = 50


class NotAllowed(Exception):
    """A page or action the signed-in person may not use (an operator's, for a trainer)."""


class Console(Protocol):
    """What a page uses of the console (`app.Console`): its settings, transcripts and rendering."""

    config: ConsoleConfig
    plays: Plays

    def render(
        self, request: Request, name: str, login: Login | None, status: int = 200, **context: Any
    ) -> HTMLResponse: ...

    def error(self, request: Request, login: Login | None, status: int, message: str) -> HTMLResponse: ...


def runtime(request: Request) -> AsyncRuntimeClient:
    """The runtime client of this request's login (`Console.guard` picks it)."""
    client: AsyncRuntimeClient = request.state.runtime
    return client


def require_operator(login: Login, what: str) -> None:
    if not login.operator:
        raise NotAllowed(f"only an operator may {what}")


async def home(console: Console, request: Request, login: Login) -> Response:
    return RedirectResponse("/library", status_code=303)


# Library ---------------------------------------------------------------------------------------


async def library(console: Console, request: Request, login: Login) -> Response:
    query = lib.Query.from_params(request.query_params, console.config.page_size)
    found = await lib.search(runtime(request), query)
    return console.render(
        request, "library.html", login, query=query, found=found, learnability=lib.LEARNABILITY
    )


async def env_page(console: Console, request: Request, login: Login) -> Response:
    env_id = request.path_params["env_id"]
    view = await lib.env_view(runtime(request), env_id)
    code: list[Any] = []
    code_error = ""
    if login.operator and request.query_params.get("code"):
        text, code_error = await lib.env_code(runtime(request), env_id)
        code = highlight(text) if text else []
    forms = [tool_form(tool.name, tool.json_schema) for tool in view.env.tools]
    return console.render(
        request, "env.html", login, view=view, forms=forms, code=code, code_error=code_error
    )


# Play ------------------------------------------------------------------------------------------


async def play_start(console: Console, request: Request, login: Login) -> Response:
    """GET: the form (an env id and a task number). POST: a new session on that task, run id
    `console`, with its history kept (so steps can be taken back), then its page."""
    if request.method == "GET":
        return console.render(
            request, "play_start.html", login, env_id=request.query_params.get("env_id", "")
        )
    form = await request.form()
    env_id = str(form.get("env_id", "")).strip()
    config_json = str(form.get("config_json", "")).strip()
    if not config_json:
        env = await runtime(request).get_env(env_id)
        try:
            number = int(str(form.get("task", "0")) or 0)
        except ValueError:
            number = -1
        if not 0 <= number < len(env.tasks):
            return console.error(
                request, login, 400, f"{env_id} has tasks 0 to {len(env.tasks) - 1}; not {form.get('task')!r}"
            )
        config_json = env.tasks[number].config_json
    created = await runtime(request).create_session(
        env_id=env_id, config=config_json, run_id=CONSOLE_RUN, keep_history=True
    )
    tools = [{"name": tool.name, "json_schema": tool.json_schema} for tool in created.tools]
    console.plays.add(
        Play(
            created.session_id,
            login.identity.tenant,
            created.env_id,
            clip(created.task_text),
            clip(config_json),
            clip(created.observation),
            tools,
            created.max_steps,
        )
    )
    return RedirectResponse(f"/play/{created.session_id}", status_code=303)


def find_play(console: Console, login: Login, session_id: str) -> Play | None:
    return console.plays.find(session_id, login.identity.tenant, login.operator)


async def play_page(
    console: Console, request: Request, login: Login, problem: str = "", status: int = 200
) -> Response:
    play = find_play(console, login, request.path_params["session_id"])
    if play is None:
        return console.error(
            request, login, 404, "no such console session (or not yours); start one from the library"
        )
    forms = [tool_form(str(tool["name"]), str(tool["json_schema"])) for tool in play.tools]
    return console.render(request, "play.html", login, play=play, forms=forms, problem=problem, status=status)


async def play_step(console: Console, request: Request, login: Login) -> Response:
    play = find_play(console, login, request.path_params["session_id"])
    if play is None:
        return console.error(request, login, 404, "no such console session (or not yours)")
    form = await request.form()
    raw = str(form.get("raw", "")).strip()
    if raw:
        try:
            action = json.loads(raw)
        except json.JSONDecodeError as exc:
            return await play_page(console, request, login, f"the raw action is not JSON: {exc}", 400)
    else:
        name = str(form.get("tool", ""))
        tool = next((t for t in play.tools if t["name"] == name), None)
        if tool is None:
            return await play_page(console, request, login, f"no tool named {name!r}", 400)
        try:
            action = {
                "name": name,
                "parameters": parameters(
                    tool_form(name, str(tool["json_schema"])), {k: str(v) for k, v in form.items()}
                ),
            }
        except BadForm as exc:
            return await play_page(console, request, login, str(exc), 400)
    answer = await runtime(request).step(
        play.session_id, json.dumps(action) if not isinstance(action, str) else action
    )
    error = answer.error.message if answer.HasField("error") and answer.error.code else ""
    play.turns.append(
        Turn(
            len(play.turns),
            clip(json.dumps(action, ensure_ascii=False) if not isinstance(action, str) else action),
            clip(answer.observation),
            answer.reward,
            answer.done,
            answer.truncated,
            clip(error),
        )
    )
    return RedirectResponse(f"/play/{play.session_id}#last", status_code=303)


async def play_fork(console: Console, request: Request, login: Login) -> Response:
    """Step back: a fork of the session at an earlier committed step (ForkSession at_step)."""
    play = find_play(console, login, request.path_params["session_id"])
    if play is None:
        return console.error(request, login, 404, "no such console session (or not yours)")
    form = await request.form()
    try:
        at_step = int(str(form.get("at_step", "")))
    except ValueError:
        return await play_page(console, request, login, "step back to which step? (a number)", 400)
    forks = await runtime(request).fork_session(play.session_id, 1, at_step=at_step)
    fork = console.plays.rewound(play, forks[0].session_id, at_step)
    return RedirectResponse(f"/play/{fork.session_id}", status_code=303)


async def play_close(console: Console, request: Request, login: Login) -> Response:
    play = find_play(console, login, request.path_params["session_id"])
    if play is not None:
        await runtime(request).close_session(play.session_id)
        console.plays.forget(play.session_id)
    return RedirectResponse("/library", status_code=303)


# Episodes --------------------------------------------------------------------------------------


async def episodes(console: Console, request: Request, login: Login) -> Response:
    from services.console import captures

    query = captures.Query.from_params(request.query_params, console.config.page_size)
    found = await captures.list_episodes(runtime(request), query)
    return console.render(request, "episodes.html", login, query=query, found=found)


async def episode_page(console: Console, request: Request, login: Login) -> Response:
    from services.console import captures

    episode = await captures.get_episode(runtime(request), request.path_params["episode_id"])
    return console.render(request, "episode.html", login, episode=episode)


# Curriculum ------------------------------------------------------------------------------------


async def curriculum(console: Console, request: Request, login: Login) -> Response:
    run_id = request.query_params.get("run", "").strip()
    every = request.query_params.get("versions", "") == "all"
    view = (
        await curriculum_view(runtime(request), run_id, 0 if every else VERSIONS_LISTED) if run_id else None
    )
    return console.render(request, "curriculum.html", login, run_id=run_id, view=view)


# Health ----------------------------------------------------------------------------------------


async def health(console: Console, request: Request, login: Login) -> Response:
    # The quarantined and the worst by error rate, from the record's index (a runtime that predates
    # `worst_envs` sends every environment, ranked here as before).
    asked = rt.StatsRequest(envs_only=True, worst_envs=ERRORS_SHOWN)
    envs = [entry.env async for entry in iter_stats(runtime(request), asked)]
    quarantined = [env for env in envs if env.quarantined]

    def error_rate(env: rt.EnvStats) -> float:
        return sum(env.step_errors.values()) / env.steps if env.steps else 0.0

    by_errors = sorted((env for env in envs if sum(env.step_errors.values())), key=error_rate, reverse=True)[
        :ERRORS_SHOWN
    ]
    rates = {env.env_id: error_rate(env) for env in by_errors}
    # Not `chart`: the template imports a macro of that name, which a context variable must not shadow.
    error_chart = plots.bar_chart(
        "error rate of the 10 worst",
        [(env.env_id[-18:], rates[env.env_id]) for env in by_errors[:10]],
        percent=True,
    )
    return console.render(
        request,
        "health.html",
        login,
        quarantined=quarantined,
        by_errors=by_errors,
        rates=rates,
        error_chart=error_chart,
    )


async def iter_stats(client: AsyncRuntimeClient, request: rt.StatsRequest) -> Any:
    async for entry in client.stub.Stats(request, timeout=max(client.timeout_s, 60.0)):
        yield entry


async def lift(console: Console, request: Request, login: Login) -> Response:
    require_operator(login, "lift a quarantine")
    form = await request.form()
    env_id = str(form.get("env_id", ""))
    await runtime(request).lift_quarantine(env_id)
    return RedirectResponse("/health", status_code=303)
