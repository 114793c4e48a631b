"""The console bench's measurements (bench/console_bench.py): each console page loaded in headless
Chromium with its load time read from Navigation Timing, the runtime calls each page makes timed
alone, and the tables of both.

A load's time is the browser's: navigation start to the end of the load event
(`performance.getEntriesByType('navigation')`, codegym_testkit/browser.py), with the moment the
console's answer began (`responseStart`: the console read the runtime and rendered the page) beside
it, so a slow page says whether the time went to the server or to the browser. The pages are loaded
in rounds, every page once per round, so other work on the machine falls on all pages alike.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit

from bench.common import Figures, Line, pct, progress
from codegym_client.api.runtime.v1 import runtime_service_pb2 as rt
from codegym_client.async_client import AsyncRuntimeClient
from codegym_testkit import browser

TARGET_MS = 300.0  # issue #40: each page loads in at most this, navigation start to the load event
PAGE_SIZE = 50  # the console's default page size (ConsoleSettings --page-size)


@dataclass(frozen=True)
class Subjects:
    """What the pages show: the run played before measuring, one of its environments, its longest
    captured episode, and the words searched."""

    run: str
    env_id: str
    episode_id: str
    search: str
    play_line: Line  # a recorded trajectory: the play page's session plays its first action


def page_paths(subjects: Subjects, play_path: str) -> dict[str, str]:
    """Each page measured and its path (the play page: a session started in the browser)."""
    return {
        "library": "/library",
        "library search": f"/library?q={quote(subjects.search)}",
        "environment": f"/env/{subjects.env_id}",
        "play": play_path,
        "episodes": "/episodes",
        "episode": f"/episodes/{subjects.episode_id}",
        "curriculum": f"/curriculum?run={quote(subjects.run)}",
        "health": "/health",
    }


# ---------------------------------------------------------------------------------------------
# The run the pages show.


async def play_run(address: str, lines: list[Line], run: str, versions: int) -> str:
    """Every line played whole (its recorded actions) for `run` at each policy version in turn, the
    record's history read after each version (a read flushes it: one point per version); the id of
    the last episode of the longest line (captured whole: the stack captures every episode)."""
    longest = max(range(len(lines)), key=lambda i: len(lines[i]["steps"]))
    episode = ""
    async with AsyncRuntimeClient(address, timeout_s=60) as client:
        await client.wait_ready(60)
        for version in range(versions):
            for i, line in enumerate(lines):
                made = await client.create_session(
                    env_id=line["env_id"], config=line["config"], run_id=run, policy_version=version
                )
                for action, _ in line["steps"]:
                    await client.step(made.session_id, action)
                await client.close_session(made.session_id)
                if i == longest:
                    episode = made.session_id
            await client.run_history(run)
    return episode


def start_play(driver: Any, base: str, line: Line) -> str:
    """A console session started through the play form on a recorded task, its first recorded action
    sent as raw JSON; the play page's path."""
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(f"{base}/play?env_id={quote(line['env_id'])}")
    driver.find_element("name", "config_json").send_keys(json.dumps(line["config"]))
    driver.find_element("id", "start-button").click()
    driver.find_element("id", "raw").send_keys(line["steps"][0][0])  # waits for the play page
    path = urlsplit(driver.current_url).path
    driver.find_element("id", "raw-send").click()
    WebDriverWait(driver, 30).until(lambda d: d.current_url.endswith("#last"))
    return path


# ---------------------------------------------------------------------------------------------
# Loads in the browser.

Loads = dict[str, list[dict[str, float]]]  # page -> each load's Navigation Timing figures


def load(driver: Any, base: str, name: str, path: str) -> dict[str, float]:
    """One load of a page, which must be the page (an error page loads fast and measures nothing)."""
    driver.get(base + path)
    figures = browser.navigation(driver)
    if figures["status"] not in (0, 200):
        raise RuntimeError(f"the {name} page ({path}) answered {figures['status']:.0f}: {driver.title!r}")
    return figures


def load_pages(driver: Any, base: str, paths: dict[str, str], rounds: int) -> tuple[Loads, Loads]:
    """One warm-up load of each page (its first: cold caches), then `rounds` rounds of every page in
    turn; (first loads, measured loads)."""
    first: Loads = {name: [load(driver, base, name, path)] for name, path in paths.items()}
    measured: Loads = {name: [] for name in paths}
    for done in range(rounds):
        for name, path in paths.items():
            measured[name].append(load(driver, base, name, path))
        if (done + 1) % max(1, rounds // 4) == 0:
            progress(f"page loads: round {done + 1} of {rounds}")
    return first, measured


def page_figures(first: Loads, measured: Loads) -> dict[str, Figures]:
    """Per page: the first load, and the measured loads' median, p90 and max (ms), the server's
    share (response start, median), the loads over the target, and the verdict on p90."""
    out: dict[str, Figures] = {}
    for name, loads in measured.items():
        times = [load["load"] for load in loads]
        out[name] = {
            "first_ms": first[name][0]["load"],
            "loads": len(times),
            "median_ms": statistics.median(times),
            "p90_ms": pct(times, 0.9),
            "max_ms": max(times),
            "answer_ms": statistics.median([load["response_start"] for load in loads]),
            "dom_ready_ms": statistics.median([load["dom_content_loaded"] for load in loads]),
            "kib": statistics.median([load["transfer_bytes"] for load in loads]) / 1024,
            "over_target": sum(t > TARGET_MS for t in times),
            "pass": pct(times, 0.9) <= TARGET_MS,
        }
    return out


def print_pages(title: str, figures: dict[str, Figures]) -> None:
    header = (
        f"{'page':<16} {'first':>7} {'median':>7} {'p90':>7} {'max':>7} {'answer':>7} {'DOM':>7}"
        f" {'KiB':>6} {'>300':>6}  p90<=300"
    )
    print(f"\n{title}")
    print(header)
    for name, f in figures.items():
        print(
            f"{name:<16} {f['first_ms']:>7.0f} {f['median_ms']:>7.0f} {f['p90_ms']:>7.0f} {f['max_ms']:>7.0f}"
            f" {f['answer_ms']:>7.0f} {f['dom_ready_ms']:>7.0f} {f['kib']:>6.1f}"
            f" {f['over_target']:>3}/{f['loads']:<2}  {'PASS' if f['pass'] else 'FAIL'}"
        )
    print(
        "  (ms in the browser from navigation start: first = the warm-up load; median/p90/max = the load "
        "event's end; answer = the console's answer began (runtime reads + render), median; DOM = "
        "DOMContentLoaded, median; KiB = the page's transfer; >300 = loads over 300 ms)"
    )


# ---------------------------------------------------------------------------------------------
# The runtime calls each page makes, timed alone.

Call = Callable[[AsyncRuntimeClient], Awaitable[object]]


async def drain_stats(client: AsyncRuntimeClient, request: rt.StatsRequest) -> int:
    return len([entry async for entry in client.stub.Stats(request, timeout=300)])


def page_calls(subjects: Subjects) -> list[tuple[str, str, Call]]:
    """(page, call, what it sends): the runtime calls behind each page, as its handler makes them
    (services/console: library.py, captures.py, curriculum.py, pages.health)."""
    s = subjects
    return [
        (
            "library",
            "SearchEnvs (first page)",
            lambda c: c.stub.SearchEnvs(rt.SearchEnvsRequest(page_size=PAGE_SIZE)),
        ),
        (
            "library search",
            f"SearchEnvs text={s.search!r}",
            lambda c: c.stub.SearchEnvs(rt.SearchEnvsRequest(text=s.search, page_size=PAGE_SIZE)),
        ),
        ("environment", "GetEnv", lambda c: c.get_env(s.env_id)),
        ("environment", "Stats env_prefix", lambda c: c.stats("", env_prefix=s.env_id)),
        (
            "environment",
            "SearchEnvs text=env id",
            lambda c: c.stub.SearchEnvs(rt.SearchEnvsRequest(text=s.env_id, page_size=20)),
        ),
        (
            "episodes",
            "ListEpisodes",
            lambda c: c.stub.ListEpisodes(rt.ListEpisodesRequest(page_size=PAGE_SIZE)),
        ),
        ("episode", "GetEpisode", lambda c: c.stub.GetEpisode(rt.GetEpisodeRequest(episode_id=s.episode_id))),
        (
            "curriculum",
            "RunHistory (pools now, bands)",
            lambda c: c.stub.RunHistory(rt.RunHistoryRequest(run_id=s.run)),
        ),
        (
            "curriculum",
            "Stats run played tasks*",
            lambda c: drain_stats(c, rt.StatsRequest(run_id=s.run, played_only=True, tasks_only=True)),
        ),
        (
            "(before)",
            "SampleTasks (the library's size)",
            lambda c: c.sample_tasks("console-size", 1, seed=1),
        ),
        (
            "health",
            "Stats worst_envs=50",
            lambda c: drain_stats(c, rt.StatsRequest(envs_only=True, worst_envs=50)),
        ),
        (
            "(before)",
            "Stats envs_only (every env)",
            lambda c: drain_stats(c, rt.StatsRequest(envs_only=True, played_only=True)),
        ),
    ]


async def time_calls(address: str, subjects: Subjects, count: int) -> list[Figures]:
    """Each page's runtime calls, `count` times each in turn from this process (gRPC round trips)."""
    rows = []
    async with AsyncRuntimeClient(address, timeout_s=60) as client:
        await client.wait_ready(60)
        for page, name, call in page_calls(subjects):
            times = []
            for _ in range(count):
                started = time.perf_counter()
                await call(client)
                times.append((time.perf_counter() - started) * 1000)
            rows.append(
                {
                    "page": page,
                    "call": name,
                    "median_ms": statistics.median(times),
                    "p90_ms": pct(times, 0.9),
                    "max_ms": max(times),
                }
            )
    return rows


def print_calls(rows: list[Figures], count: int) -> None:
    print(f"\nthe runtime calls behind each page, each timed alone ({count} calls, gRPC round trip, ms)")
    print(f"{'page':<16} {'call':<34} {'median':>7} {'p90':>7} {'max':>7}")
    for row in rows:
        print(
            f"{row['page']:<16} {row['call']:<34} {row['median_ms']:>7.1f} {row['p90_ms']:>7.1f}"
            f" {row['max_ms']:>7.1f}"
        )
    print(
        "  * read by the page only for a run of at most 1,000 played tasks (services/console/curriculum.py); "
        "(before): what Health read before worst_envs, and Curriculum before library_tasks"
    )


def loads_in_thread(
    driver: Any, base: str, paths: dict[str, str], rounds: int
) -> Awaitable[tuple[Loads, Loads]]:
    """`load_pages` off the event loop (the rollouts of a load run on it)."""
    return asyncio.to_thread(load_pages, driver, base, paths, rounds)
