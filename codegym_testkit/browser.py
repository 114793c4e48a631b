"""Headless Chromium through Selenium, for the console's browser tests and `make console-shots`.

Debian's `chromium` and `chromium-driver` (`make install` installs both: Playwright cannot download
its browser here). Where they are missing, `BrowserMissing` says so; the tests then skip, except
under `CI=true`, where they fail: a run that drove no browser must not pass as green.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

CHROMIUM = ("chromium", "chromium-browser")
DRIVER = ("chromedriver",)
# Flags that work in this container (no GPU, no sandbox for root, no network beyond loopback).
FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1280,900",
)


def find(names: tuple[str, ...]) -> str | None:
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    return None


class BrowserMissing(RuntimeError):
    """Chromium or its driver is not installed."""


def require_browser() -> tuple[str, str]:
    """(chromium, chromedriver) paths; BrowserMissing when either is not installed."""
    browser, driver = find(CHROMIUM), find(DRIVER)
    if browser and driver:
        return browser, driver
    missing = " and ".join(n for n, p in (("chromium", browser), ("chromium-driver", driver)) if not p)
    message = (
        f"{missing} not installed (make install installs them: Debian packages chromium chromium-driver)"
    )
    raise BrowserMissing(message)


@contextmanager
def chromium(width: int = 1280, height: int = 900) -> Iterator[Any]:
    """A headless Chromium driven by Selenium, with a fresh profile, quit on the way out."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    browser, driver_path = require_browser()
    profile = tempfile.mkdtemp(prefix="console-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--window-size={width},{height}")
    options.add_argument(f"--user-data-dir={profile}")
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


# The current page's Navigation Timing (Level 2) entry, its phases in ms from navigation start:
# null until its load event has ended (a driver's `get` returns once the document is complete,
# which comes just before the load event runs).
NAVIGATION = """
const e = performance.getEntriesByType('navigation')[0];
if (!e || !e.loadEventEnd) return null;
return {response_start: e.responseStart - e.startTime, response_end: e.responseEnd - e.startTime,
        dom_content_loaded: e.domContentLoadedEventEnd - e.startTime,
        load: e.loadEventEnd - e.startTime, transfer_bytes: e.transferSize,
        status: e.responseStatus || 0};
"""


def navigation(driver: Any, timeout_s: float = 10.0) -> dict[str, float]:
    """The current page's load in the browser, from Navigation Timing: `load` (navigation start to
    the end of the load event) and its phases (`response_start`: the server's answer began;
    `response_end`; `dom_content_loaded`), in ms, `transfer_bytes`, and the HTTP `status` (0 where
    the browser does not tell)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = driver.execute_script(NAVIGATION)
        if found is not None:
            return {key: float(value) for key, value in found.items()}
        if time.monotonic() > deadline:
            raise TimeoutError(f"no load event ended on {driver.current_url} within {timeout_s:g} s")
        time.sleep(0.005)


def load_ms(driver: Any) -> float:
    """The current page's load time in the browser: navigation start to the load event's end
    (Navigation Timing)."""
    return navigation(driver)["load"]
