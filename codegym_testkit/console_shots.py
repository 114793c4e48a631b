"""`make console-shots`: a screenshot of each console page into docs/console/ (PNG), and each page's
load time measured in the browser, on an idle stack over a library of the published size.

The stack: one sandbox worker, a runtime over a library of `--envs` environments with `--tasks`
task configs each (copies of a verified sample, `big_library`; 20,000 x 4 = 80,000 tasks plus the
samples by default) capturing every episode, and the console without tokens (loopback). A few
episodes are played first for the run `shots` at 5 policy versions (a rewarded group, a flagged
shortcut, a group answered wrong then right), so Episodes and Curriculum have something to
show; then each page is loaded `--loads` times in headless Chromium and its load time read from
Navigation Timing (navigation start to the end of the load event). Prints one line per page:
median and worst in milliseconds, and the library size.

  .venv/bin/python -m codegym_testkit.console_shots --out docs/console
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import statistics
import sys
import tempfile
from pathlib import Path

from codegym import procs
from codegym.library.store import canonical_config
from codegym.samples import TRAJECTORIES
from codegym_client import RuntimeClient
from codegym_testkit import big_library, browser

GCD = big_library.TEMPLATE
RUN = "shots"
SHORTCUT = {"nums": [7, 13]}  # its oracle set to 40 steps below: answered at once, a flagged shortcut


def server(args: list[str]) -> procs.ServerProcess:
    return procs.ServerProcess(procs.codegym_command(args), name=" ".join(args[:2]), timeout_s=300.0)


def play_some(runtime: str) -> str:
    """Episodes for the run: the oracle's (rewarded), a shortcut (flagged), a wrong answer; the
    rewarded episode's id."""
    run = next(
        json.loads(line)
        for line in TRAJECTORIES.read_text().splitlines()
        if json.loads(line)["env_id"] == GCD and json.loads(line)["reward"] == 1.0
    )
    played = ""
    oracle = (run["config"], [a for a, _ in run["steps"]])
    with RuntimeClient(runtime) as client:
        # Per version: the oracle's task twice (a group of equal rewards: zero variance), the
        # shortcut once, and a task answered wrong then right (a group that teaches). A task
        # decides its pool at its 4th episode: the oracle's is mastered at v1.
        for version in range(5):
            for config, actions in (
                oracle,
                oracle,
                (SHORTCUT, ['{"name": "Done", "parameters": {"answer": 1}}']),
                ({"nums": [10, 10]}, ['{"name": "Done", "parameters": {"answer": 3}}']),
                ({"nums": [10, 10]}, ['{"name": "Done", "parameters": {"answer": 10}}']),
            ):
                made = client.create_session(env_id=GCD, config=config, run_id=RUN, policy_version=version)
                for action in actions:
                    client.step(made.session_id, action)
                client.close_session(made.session_id)
                played = played or made.session_id
            client.run_history(RUN)  # a read flushes the record: one history point per version
    return played


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="docs/console", help="folder of the screenshots")
    parser.add_argument("--envs", type=int, default=20_000, help="environments copied into the library")
    parser.add_argument("--tasks", type=int, default=4, help="task configs per copied environment")
    parser.add_argument(
        "--loads", type=int, default=5, help="loads of each page measured (after one warm-up)"
    )
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="console-shots-"))
    library = big_library.build(work / "library.db", args.envs, args.tasks)
    with sqlite3.connect(library) as db:
        db.execute(
            "UPDATE tasks SET solve_fc_round = 40 WHERE env_id = ? AND config_json = ?",
            (GCD, canonical_config(SHORTCUT)),
        )
        envs, tasks = db.execute(
            "SELECT (SELECT COUNT(*) FROM envs), (SELECT COUNT(*) FROM tasks)"
        ).fetchone()
    print(f"library: {envs:,} environments, {tasks:,} tasks ({library})", flush=True)
    started: list[procs.ServerProcess] = []
    try:
        worker = server(["serve", "sandbox", "--port", "0", "--jails", "1"])
        started.append(worker)
        serve = ["serve", "runtime", "--port", "0", "--library", str(library), "--sandbox", worker.address]
        runtime = server([*serve, "--capture", "1", "--record", str(work / "record.db")])
        started.append(runtime)
        console = server(["console", "--target", runtime.address, "--port", "0"])
        started.append(console)
        episode = play_some(runtime.address)
        base = f"http://{console.address}"
        pages = {
            "library": "/library",
            "library-search": "/library?q=Many_01234",
            "env": f"/env/{GCD}",
            "play": "",  # a session started below
            "episodes": f"/episodes?run={RUN}",
            "episode": f"/episodes/{episode}",
            "curriculum": f"/curriculum?run={RUN}",
            "health": "/health",
        }
        with browser.chromium(1280, 1000) as driver:
            driver.implicitly_wait(10)
            driver.get(f"{base}/play?env_id={GCD}")
            driver.find_element("name", "config_json").send_keys(json.dumps({"nums": [12, 18, 24]}))
            driver.find_element("id", "start-button").click()
            driver.find_element("css selector", "form.tool-form[data-tool='Observe'] button.call").click()
            pages["play"] = driver.current_url.removeprefix(base).split("#")[0]
            print(
                f"{'page':<16} {'median ms':>10} {'worst ms':>9}  (navigation start to load event end; {args.loads} loads)"
            )
            for name, path in pages.items():
                driver.get(base + path)  # warm-up
                times = []
                for _ in range(args.loads):
                    driver.get(base + path)
                    times.append(browser.load_ms(driver))
                height = driver.execute_script("return document.documentElement.scrollHeight")
                driver.set_window_size(1280, min(max(int(height) + 40, 600), 1400))
                driver.save_screenshot(str(out / f"{name}.png"))
                driver.set_window_size(1280, 1000)
                print(f"{name:<16} {statistics.median(times):>10.0f} {max(times):>9.0f}", flush=True)
    finally:
        for proc in reversed(started):
            proc.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
