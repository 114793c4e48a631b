"""The web console (issue #40) in a real browser: headless Chromium driven through Selenium, against
real servers on port 0 (a sandbox worker, a runtime taking the tokens file, the console calling the
runtime with the service token), as `codegym up --auth --console-port` wires them.

People sign in with a token; a page is refused without one; a trainer plays a sample task to
reward 1 through the forms built from its tools' schemas and steps back with a fork; a hostile
observation (`<script>`) shows as text and runs nothing; search finds an environment in a library
of a few thousand; a run's curriculum plot changes after its episodes are played; captured
episodes (a whole one and a flagged one) open as timelines, and a trainer cannot see another
tenant's; only operators read code or lift quarantines.

Without Chromium (Debian's `chromium` and `chromium-driver`) these tests skip, and fail under
`CI=true`.
"""

from __future__ import annotations

import json
import os
import sqlite3
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from codegym.library.records import TaskRecord
from codegym.library.store import Library, canonical_config
from codegym.samples import ENVS, TRAJECTORIES
from codegym.server.auth import OPERATOR, SERVICE, TRAINER, Identity, write_tokens
from codegym_client import RuntimeClient
from codegym_client.api.runtime.v1 import runtime_service_pb2 as rt
from codegym_client.channels import TLS_CA_ENV, TOKEN_ENV
from codegym_testkit import big_library, browser
from tests.helpers.servers import CodegymServer, sandbox_workers

pytestmark = pytest.mark.jail  # the stack has a sandbox worker

TOKENS = {
    "trainer-a": Identity("team-a", TRAINER),
    "trainer-b": Identity("team-b", TRAINER),
    "operator": Identity("ops", OPERATOR),
    "service-token": Identity("codegym", SERVICE),
}
GCD = "Sample_0006_I__ArrayGcdEnv"
HOSTILE = "Hostile_0001_I__ArrayGcdEnv"
# What the hostile environment's `Evil` tool answers: markup that must show as text.
HOSTILE_TEXT = "<script>window.pwned = 1; document.title = 'pwned'</script><b id=\"injected\">bold</b>"
BROKEN = "Broken_0001_I__ArrayGcdEnv"  # the GCD sample whose Observe never returns: its step times out
FLAGGED_TASK = {"nums": [7, 13]}  # answered at once: rewarded in 1 step of an oracle's 40
MANY = 3000  # copies of a sample environment: "a library of a few thousand"
NEEDLE = "Lighthouse_0001_I__ArrayGcdEnv"  # one copy's id, for search to find


def environ(**extra: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in (TOKEN_ENV, TLS_CA_ENV, "CODEGYM_TOKENS_FILE", "CI")
    }
    return {**env, **extra}


@pytest.fixture(scope="module")
def driver() -> Iterator[Any]:
    try:
        browser.require_browser()
    except browser.BrowserMissing as exc:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true and no browser: {exc}")
        pytest.skip(str(exc))
    with browser.chromium() as chromium:
        yield chromium


def many_library(path: Path) -> Path:
    """The samples, `MANY` copies of the GCD sample (one named `NEEDLE`) and a hostile environment:
    the GCD sample whose Observe answers markup."""
    big_library.build(path, MANY, tasks_per_env=1, names={MANY // 2: NEEDLE})
    gcd = (ENVS / f"{GCD}.py").read_text()
    evil = gcd.replace("return str(len(self.nums))", f"return {HOSTILE_TEXT!r}", 1)
    assert evil != gcd
    with sqlite3.connect(path) as db:  # the flagged task's oracle takes 40 steps: 1 is a shortcut
        db.execute(
            "UPDATE tasks SET solve_fc_round = 40 WHERE env_id = ? AND config_json = ?",
            (GCD, canonical_config(FLAGGED_TASK)),
        )
        assert db.execute("SELECT changes()").fetchone()[0] == 1
    with Library(path) as library:
        report = library.put_environment(
            HOSTILE,
            evil,
            task_text="A hostile environment.",
            metadata={},
            tasks=[TaskRecord(HOSTILE, '{"nums": [2, 4]}')],
        )
    assert report.skipped == [], report.skipped
    broken = gcd.replace("return str(len(self.nums))", "while True:\n            pass", 1)
    with Library(path) as library:
        report = library.put_environment(
            BROKEN,
            broken,
            task_text="An environment whose Observe never returns.",
            metadata={},
            tasks=[TaskRecord(BROKEN, '{"nums": [2, 4]}')],
        )
    assert report.skipped == [], report.skipped
    return path


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """{"runtime": address, "console": base URL}: every server takes the tokens file; the runtime
    and the console call on with the service token."""
    folder = tmp_path_factory.mktemp("console")
    tokens = folder / "tokens.json"
    write_tokens(tokens, TOKENS)
    library = many_library(folder / "library.db")
    env = environ(CODEGYM_TOKENS_FILE=str(tokens), CODEGYM_TOKEN="service-token")
    with sandbox_workers(1, env=env) as workers:
        runtime = console = None
        try:
            args = ["serve", "runtime", "--port", "0", "--library", str(library)]
            args += ["--sandbox", workers[0].address, "--capture", "1"]  # every episode captured whole
            runtime = CodegymServer(args, env=env)
            console = CodegymServer(["console", "--target", runtime.address, "--port", "0"], env=env)
            yield {"runtime": runtime.address, "console": f"http://{console.address}"}
        finally:
            for proc in (console, runtime):
                if proc is not None:
                    assert proc.stop() == 0, proc.text[-3000:]


def sign_in(driver: Any, base: str, token: str) -> None:
    from selenium.webdriver.common.by import By

    driver.delete_all_cookies()
    driver.get(f"{base}/login")
    driver.find_element(By.ID, "token").send_keys(token)
    click(driver, driver.find_element(By.ID, "signin"))
    assert "/login" not in driver.current_url, text_of(driver, "main")


def text_of(driver: Any, css: str) -> str:
    from selenium.webdriver.common.by import By

    return str(driver.find_element(By.CSS_SELECTOR, css).text)


def post(url: str, fields: dict[str, str], cookie: str = "") -> tuple[int, str]:
    request = urllib.request.Request(url, data=urllib.parse.urlencode(fields).encode(), method="POST")
    if cookie:
        request.add_header("Cookie", cookie)
    opener = urllib.request.build_opener(NoRedirect)
    try:
        with opener.open(request, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


class NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


# Access ----------------------------------------------------------------------------------------


def test_refused_without_a_token(driver: Any, stack: dict[str, str]) -> None:
    from selenium.webdriver.common.by import By

    base = stack["console"]
    driver.delete_all_cookies()
    for page in ("/library", f"/env/{GCD}", "/play", "/episodes", "/curriculum?run=x", "/health"):
        driver.get(base + page)
        assert urllib.parse.urlparse(driver.current_url).path == "/login", (page, driver.current_url)
        assert (
            text_of(driver, "h1") == "Sign in" and driver.find_elements(By.CSS_SELECTOR, "table, nav") == []
        )
    # A POST without a login is refused outright (no redirect that a script could follow).
    status, body = post(f"{base}/play", {"env_id": GCD, "task": "0"})
    assert status == 401 and "sign in first" in body
    # An unknown token, and a server's own service token, do not sign in.
    for token, why in (("nope", "does not know that token"), ("service-token", "a service's token")):
        driver.get(f"{base}/login")
        driver.find_element(By.ID, "token").send_keys(token)
        click(driver, driver.find_element(By.ID, "signin"))
        assert why in text_of(driver, "#problem")
        assert driver.get_cookies() == []


def test_the_login_cookie_is_http_only_and_strict_and_posts_need_the_csrf_token(
    driver: Any, stack: dict[str, str]
) -> None:
    base = stack["console"]
    sign_in(driver, base, "trainer-a")
    (cookie,) = driver.get_cookies()
    assert cookie["httpOnly"] is True and cookie["sameSite"] == "Strict", cookie
    assert driver.execute_script("return document.cookie") == ""  # no script reads it
    assert "team-a" in text_of(driver, "#who")
    jar = f"{cookie['name']}={cookie['value']}"
    status, body = post(f"{base}/play", {"env_id": GCD, "task": "0"}, cookie=jar)
    assert status == 403 and "CSRF" in body
    status, body = post(f"{base}/play", {"env_id": GCD, "task": "0", "csrf": "forged"}, cookie=jar)
    assert status == 403 and "CSRF" in body


# Play ------------------------------------------------------------------------------------------


def oracle_run(env_id: str) -> dict[str, Any]:
    for line in TRAJECTORIES.read_text().splitlines():
        run = json.loads(line)
        if run["env_id"] == env_id and run["reward"] == 1.0:
            return run
    raise AssertionError(f"no rewarded sample trajectory of {env_id}")


def call_through_form(driver: Any, action: dict[str, Any]) -> None:
    """Fill the tool's form from the action's parameters and press its button."""
    from selenium.webdriver.common.by import By

    form = driver.find_element(By.CSS_SELECTOR, f"form.tool-form[data-tool='{action['name']}']")
    for name, value in action["parameters"].items():
        field = form.find_element(By.NAME, f"p.{name}")
        if field.get_attribute("type") == "checkbox":
            if bool(value) != field.is_selected():
                field.click()
        elif field.tag_name == "textarea":
            field.send_keys(json.dumps(value))
        else:
            field.send_keys(str(value))
    click(driver, form.find_element(By.CSS_SELECTOR, "button.call"))


def click(driver: Any, element: Any) -> None:
    """Click `element` and wait for the page it leads to."""
    from selenium.common.exceptions import WebDriverException

    try:
        element.click()
    except WebDriverException as exc:
        if not gone(exc):
            raise
    reloaded(driver, element)


def gone(exc: Exception) -> bool:
    """Whether a command failed because its element's page was replaced: chromedriver says so as a
    stale element or, when the replacement is under way, as a node outside the document."""
    from selenium.common.exceptions import StaleElementReferenceException

    return isinstance(exc, StaleElementReferenceException) or "does not belong to the document" in str(exc)


def reloaded(driver: Any, element: Any) -> None:
    """Wait for the next page: `element`, of the page a click left, is gone, and the new one loaded."""
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.support.wait import WebDriverWait

    def stale(_: Any) -> bool:
        try:
            element.is_enabled()
        except WebDriverException as exc:
            if gone(exc):
                return True
            raise
        return False

    WebDriverWait(driver, 30).until(stale)
    WebDriverWait(driver, 30).until(lambda d: d.execute_script("return document.readyState") == "complete")


def start_play(driver: Any, base: str, env_id: str, config: dict[str, Any]) -> str:
    """Start a session from the Play form; the new session's id."""
    from selenium.webdriver.common.by import By

    driver.get(f"{base}/play")
    driver.find_element(By.ID, "env_id").send_keys(env_id)
    driver.find_element(By.NAME, "config_json").send_keys(json.dumps(config))
    click(driver, driver.find_element(By.ID, "start-button"))
    assert "/play/" in driver.current_url, text_of(driver, "main")
    return text_of(driver, "#session-id")


def test_a_trainer_plays_a_sample_task_to_reward_1_through_the_forms_and_steps_back(
    driver: Any, stack: dict[str, str]
) -> None:
    from selenium.webdriver.common.by import By

    base = stack["console"]
    sign_in(driver, base, "trainer-a")
    run = oracle_run(GCD)
    session_id = start_play(driver, base, GCD, run["config"])
    assert run["first"] in text_of(driver, "#timeline")
    for number, (action_text, observation) in enumerate(run["steps"], start=1):
        call_through_form(driver, json.loads(action_text))
        turns = driver.find_elements(By.CSS_SELECTOR, "#timeline li.turn")
        assert len(turns) == number + 1  # the reset, then one per step
        assert turns[-1].find_element(By.CSS_SELECTOR, "pre.obs").text == observation
    assert text_of(driver, "#final-reward") == "1"
    assert "Episode over" in text_of(driver, "#outcome")
    assert driver.find_elements(By.CSS_SELECTOR, "form.tool-form") == []  # nothing left to call
    # Step back before the last step: a fork at the step before it, its transcript cut there.
    click(driver, driver.find_elements(By.CSS_SELECTOR, "button.step-back")[-1])
    assert session_id not in driver.current_url
    assert text_of(driver, "#final-reward") == "0"
    assert len(driver.find_elements(By.CSS_SELECTOR, "#timeline li.turn")) == len(run["steps"])
    call_through_form(driver, json.loads(run["steps"][-1][0]))
    assert text_of(driver, "#final-reward") == "1"


def test_a_hostile_observation_shows_as_text(driver: Any, stack: dict[str, str]) -> None:
    from selenium.webdriver.common.by import By

    base = stack["console"]
    sign_in(driver, base, "trainer-a")
    start_play(driver, base, HOSTILE, {"nums": [2, 4]})
    call_through_form(driver, {"name": "Observe", "parameters": {}})
    observation = driver.find_elements(By.CSS_SELECTOR, "#timeline li.turn pre.obs")[-1]
    assert observation.text == HOSTILE_TEXT  # the markup, as characters
    assert driver.find_elements(By.ID, "injected") == []  # no element was made of it
    assert driver.execute_script("return window.pwned === undefined")
    assert driver.title != "pwned"
    # A raw action naming a tool that is markup is shown as text too.
    driver.find_element(By.ID, "raw").send_keys(
        json.dumps({"name": "<img src=x id=evil2>", "parameters": {}})
    )
    click(driver, driver.find_element(By.ID, "raw-send"))
    assert "<img src=x id=evil2>" in text_of(driver, "#timeline")
    assert driver.find_elements(By.ID, "evil2") == []


# Library ---------------------------------------------------------------------------------------


def test_search_finds_an_environment_in_a_library_of_thousands(driver: Any, stack: dict[str, str]) -> None:
    from selenium.webdriver.common.by import By

    base = stack["console"]
    sign_in(driver, base, "trainer-a")
    driver.get(f"{base}/library")
    rows = driver.find_elements(By.CSS_SELECTOR, "#envs a.env-link")
    assert len(rows) == 50 and driver.find_elements(By.ID, "next")  # paged
    box = driver.find_element(By.ID, "q")
    box.send_keys("lighthouse")
    box.submit()
    reloaded(driver, box)
    found = [a.text for a in driver.find_elements(By.CSS_SELECTOR, "#envs a.env-link")]
    assert found == [NEEDLE], found
    assert text_of(driver, "#total").startswith("1 ")
    click(driver, driver.find_element(By.CSS_SELECTOR, "#envs a.env-link"))
    assert text_of(driver, "#env-id") == found[0]
    schema = driver.find_element(By.CSS_SELECTOR, "details.tool pre.schema").get_attribute("textContent")
    assert json.loads(schema)["type"] == "function"  # the schema a trainer's model is given


def test_only_operators_read_code_and_lift_quarantines(driver: Any, stack: dict[str, str]) -> None:
    from selenium.webdriver.common.by import By

    base = stack["console"]
    sign_in(driver, base, "trainer-a")
    driver.get(f"{base}/env/{GCD}?code=1")
    assert driver.find_elements(By.ID, "code") == [] and driver.find_elements(By.ID, "show-code") == []
    assert "import" not in text_of(driver, "main") or "class ArrayGcdEnv" not in text_of(driver, "main")
    (cookie,) = driver.get_cookies()
    driver.get(f"{base}/health")
    csrf = driver.find_element(By.CSS_SELECTOR, "#who input[name=csrf]").get_attribute("value")
    status, body = post(
        f"{base}/health/lift", {"env_id": GCD, "csrf": csrf}, cookie=f"{cookie['name']}={cookie['value']}"
    )
    assert status == 403 and "only an operator" in body
    sign_in(driver, base, "operator")
    driver.get(f"{base}/env/{GCD}")
    click(driver, driver.find_element(By.ID, "show-code"))
    code = text_of(driver, "#code")
    assert "class ArrayGcdEnv" in code
    assert driver.find_elements(By.CSS_SELECTOR, "#code span.k")  # highlighted


def test_health_lists_environments_by_error_rate_with_their_chart(driver: Any, stack: dict[str, str]) -> None:
    from selenium.webdriver.common.by import By

    with RuntimeClient(stack["runtime"], token="trainer-a") as client:
        made = client.create_session(
            env_id=BROKEN, config={"nums": [2, 4]}, run_id="health", step_timeout_ms=200
        )
        answer = client.step(made.session_id, {"name": "Observe", "parameters": {}})
        assert answer.error.code == rt.STEP_ERROR_CODE_STEP_TIMEOUT, answer
        client.close_session(made.session_id)
    base = stack["console"]
    sign_in(driver, base, "operator")
    driver.get(f"{base}/health")
    rows = {
        row.find_element(By.CSS_SELECTOR, "td a").text: row.find_elements(By.CSS_SELECTOR, "td")[1].text
        for row in driver.find_elements(By.CSS_SELECTOR, "#errors tbody tr")
        if row.find_elements(By.CSS_SELECTOR, "td a")
    }
    assert rows.get(BROKEN) == "100.0%", rows
    drawn = driver.find_elements(By.CSS_SELECTOR, "#error-chart rect")
    assert BROKEN[-18:] in [rect.get_attribute("data-label") for rect in drawn]


# Curriculum ------------------------------------------------------------------------------------


def bars(driver: Any) -> dict[str, str]:
    from selenium.webdriver.common.by import By

    chart = driver.find_elements(By.CSS_SELECTOR, "#charts figure.chart")[0]
    return {
        rect.get_attribute("data-label"): rect.get_attribute("data-value")
        for rect in chart.find_elements(By.CSS_SELECTOR, "rect")
    }


def test_a_runs_curriculum_plot_changes_after_episodes_are_played(driver: Any, stack: dict[str, str]) -> None:
    base = stack["console"]
    sign_in(driver, base, "trainer-a")
    driver.get(f"{base}/curriculum?run=grpo-7")
    before = bars(driver)
    assert set(before) == {"unseen", "learnable", "mastered", "unsolved"}
    assert before["mastered"] == "0" and before["unsolved"] == "0"
    run = oracle_run(GCD)
    wrong = {"name": "Done", "parameters": {"answer": 2}}  # gcd(7, 13) is 1
    with RuntimeClient(stack["runtime"], token="trainer-a") as client:
        for version in range(4):  # one task solved 4 times (mastered), another failed 4 times (unsolved)
            for config, actions in (
                (run["config"], [a for a, _ in run["steps"]]),
                ({"nums": [7, 13]}, [wrong]),
            ):
                created = client.create_session(
                    env_id=GCD, config=config, run_id="grpo-7", policy_version=version
                )
                for action in actions:
                    client.step(created.session_id, action)
                client.close_session(created.session_id)
    driver.get(f"{base}/curriculum?run=grpo-7")
    after = bars(driver)
    assert after != before
    assert after["mastered"] == "1" and after["unsolved"] == "1", after
    assert int(after["unseen"]) == int(before["unseen"]) - 2


def history_rows(driver: Any) -> dict[str, list[str]]:
    """The pools-over-versions table: policy version -> its cells (unseen, learnable, mastered,
    unsolved, change)."""
    from selenium.webdriver.common.by import By

    rows = driver.find_elements(By.CSS_SELECTOR, "#history tbody tr[data-version]")
    return {
        row.get_attribute("data-version"): [
            cell.text for cell in row.find_elements(By.CSS_SELECTOR, "td")[1:]
        ]
        for row in rows
    }


def version_bars(driver: Any) -> dict[str, str]:
    from selenium.webdriver.common.by import By

    return {
        rect.get_attribute("data-label"): rect.get_attribute("data-value")
        for rect in driver.find_elements(By.CSS_SELECTOR, "#version-chart rect")
    }


def rows_of(driver: Any, table: str) -> dict[str, list[str]]:
    """A by-version table's rows: policy version -> its cells after the version."""
    from selenium.webdriver.common.by import By

    rows = driver.find_elements(By.CSS_SELECTOR, f"#{table} tbody tr[data-version]")
    return {
        row.get_attribute("data-version"): [
            cell.text for cell in row.find_elements(By.CSS_SELECTOR, "td")[1:]
        ]
        for row in rows
    }


def moves_of(driver: Any) -> dict[str, dict[str, str]]:
    """The moves table: policy version -> {"from>to": tasks}."""
    from selenium.webdriver.common.by import By

    return {
        row.get_attribute("data-version"): {
            move.get_attribute("data-move"): move.get_attribute("data-tasks")
            for move in row.find_elements(By.CSS_SELECTOR, ".move")
        }
        for row in driver.find_elements(By.CSS_SELECTOR, "#moves tbody tr[data-version]")
    }


def zero_variance_bars(driver: Any) -> dict[str, str]:
    from selenium.webdriver.common.by import By

    return {
        rect.get_attribute("data-label"): rect.get_attribute("data-value")
        for rect in driver.find_elements(By.CSS_SELECTOR, "#zero-variance-chart rect")
    }


def test_pools_by_policy_version_follow_episodes_played_at_two_versions(
    driver: Any, stack: dict[str, str]
) -> None:
    """The tables and plots come from the record's RunHistory: a version's row stays as it stood,
    the next version's row adds what its episodes did; each version's groups (their zero-variance
    share) and its tasks that moved pools are counted from the same episodes."""
    base, run_id = stack["console"], "grpo-versions"
    sign_in(driver, base, "trainer-a")
    driver.get(f"{base}/curriculum?run={run_id}")
    assert history_rows(driver) == {} and version_bars(driver) == {}
    assert rows_of(driver, "groups") == {} and moves_of(driver) == {} and zero_variance_bars(driver) == {}
    run = oracle_run(GCD)
    solved = (run["config"], [a for a, _ in run["steps"]])
    failed = ({"nums": [11, 13]}, [{"name": "Done", "parameters": {"answer": 2}}])  # gcd is 1
    right = ({"nums": [11, 13]}, [{"name": "Done", "parameters": {"answer": 1}}])

    def play_at(version: int, config: dict[str, Any], actions: list[Any], times: int = 4) -> None:
        with RuntimeClient(stack["runtime"], token="trainer-a") as client:
            for _ in range(times):  # 4 episodes: past "still measured", so the pool is decided
                created = client.create_session(
                    env_id=GCD, config=config, run_id=run_id, policy_version=version
                )
                for action in actions:
                    client.step(created.session_id, action)
                client.close_session(created.session_id)

    play_at(3, *solved)
    driver.get(f"{base}/curriculum?run={run_id}")
    first = history_rows(driver)
    assert list(first) == ["3"], first
    assert first["3"][1:4] == ["0", "1", "0"] and first["3"][4] == "+0 / +1 / +0", first
    assert version_bars(driver)["3:mastered"] == "1"

    play_at(5, *failed)
    driver.get(f"{base}/curriculum?run={run_id}")
    second = history_rows(driver)
    assert list(second) == ["3", "5"], second
    assert second["3"] == first["3"]  # the earlier version's row is as it stood
    assert second["5"][1:4] == ["0", "1", "1"] and second["5"][4] == "+0 / +0 / +1", second
    assert int(second["5"][0]) == int(first["3"][0]) - 1  # one more task left the unseen
    drawn = version_bars(driver)
    assert drawn["5:unsolved"] == "1" and drawn["5:mastered"] == "1" and drawn["3:unsolved"] == "0", drawn
    # Each version's group has 4 equal rewards: zero variance; each task left the unseen.
    assert rows_of(driver, "groups") == {"3": ["1", "1", "1", "100%"], "5": ["1", "1", "1", "100%"]}
    assert zero_variance_bars(driver) == {"3": "100%", "5": "100%"}
    assert moves_of(driver) == {"3": {"unseen>mastered": "1"}, "5": {"unseen>unsolved": "1"}}

    # At version 6 the unsolved task is answered right twice and wrong twice: a group that teaches.
    play_at(6, *right, times=2)
    play_at(6, *failed, times=2)
    driver.get(f"{base}/curriculum?run={run_id}")
    assert rows_of(driver, "groups")["6"] == ["1", "1", "0", "0%"]
    assert zero_variance_bars(driver)["6"] == "0%"
    assert moves_of(driver)["6"] == {"unsolved>learnable": "1"}
    assert "67% of 3 groups of two episodes or more" in text_of(driver, "#zero-variance-note")


# Episodes --------------------------------------------------------------------------------------


def play(runtime: str, token: str, run_id: str, config: dict[str, Any], actions: list[str]) -> str:
    with RuntimeClient(runtime, token=token) as client:
        created = client.create_session(env_id=GCD, config=config, run_id=run_id)
        for action in actions:
            client.step(created.session_id, action)
        client.close_session(created.session_id)
    return str(created.session_id)


def listed(driver: Any) -> list[str]:
    from selenium.webdriver.common.by import By

    return [
        a.get_attribute("href").rsplit("/", 1)[-1]
        for a in driver.find_elements(By.CSS_SELECTOR, "#episodes a.episode-link")
    ]


def test_captured_episodes_open_as_timelines_and_stay_with_their_tenant(
    driver: Any, stack: dict[str, str]
) -> None:
    from selenium.webdriver.common.by import By

    base, runtime = stack["console"], stack["runtime"]
    run = oracle_run(GCD)
    oracle = [action for action, _ in run["steps"]]
    answer = json.dumps({"name": "Done", "parameters": {"answer": 1}})
    whole = play(runtime, "trainer-a", "run-a", run["config"], oracle)
    flagged = play(runtime, "trainer-a", "run-a", FLAGGED_TASK, [answer])
    theirs = play(runtime, "trainer-b", "run-b", run["config"], oracle)

    sign_in(driver, base, "trainer-a")
    driver.get(f"{base}/episodes?run=run-a")
    assert listed(driver) == [flagged, whole]  # newest first
    driver.find_element(By.ID, "flagged").click()  # the checkbox, then the filter
    click(driver, driver.find_element(By.CSS_SELECTOR, "#filters button"))
    assert listed(driver) == [flagged]
    click(driver, driver.find_element(By.CSS_SELECTOR, "#episodes a.episode-link"))
    assert text_of(driver, "#episode-id") == flagged
    assert "flagged" in text_of(driver, "main") and text_of(driver, "#episode-reward") == "1"
    steps = driver.find_elements(By.CSS_SELECTOR, "#timeline li.turn pre.act")
    assert [json.loads(s.text) for s in steps] == [json.loads(answer)]

    driver.get(f"{base}/episodes/{whole}")
    observations = [o.text for o in driver.find_elements(By.CSS_SELECTOR, "#timeline li.turn pre.obs")]
    assert observations == [run["first"], *(obs for _, obs in run["steps"])]
    assert text_of(driver, "#episode-reward") == "1"

    # Another tenant's capture: not listed, and opening it by id finds nothing.
    driver.get(f"{base}/episodes?run=run-b")
    assert listed(driver) == []
    driver.get(f"{base}/episodes/{theirs}")
    assert theirs not in text_of(driver, "main") or "not" in text_of(driver, "#problem")
    assert driver.find_elements(By.ID, "timeline") == []
    # An operator sees every tenant's, with the tenant named.
    sign_in(driver, base, "operator")
    driver.get(f"{base}/episodes?run=run-b")
    assert listed(driver) == [theirs] and "team-b" in text_of(driver, "#episodes")
