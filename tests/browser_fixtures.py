"""A real headless browser (Debian's `chromium` and `chromium-driver`, driven by selenium) for
the tests of the page the server serves at `/` (tests/test_web_ui.py)."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from typing import Any

import pytest

CHROMIUM = ("chromium", "chromium-browser", "google-chrome")


def _find(names: tuple[str, ...]) -> str | None:
    return next((path for path in map(shutil.which, names) if path), None)


@pytest.fixture(scope="session")
def browser():
    """One headless Chromium for the session; its console log is read by the tests."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary, driver = _find(CHROMIUM), _find(("chromedriver",))
    if binary is None or driver is None:
        pytest.skip("chromium and chromedriver are not installed (scripts/test.sh installs them)")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                 "--window-size=1400,1000", "--disable-gpu"):  # fmt: skip
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    chrome = webdriver.Chrome(service=Service(executable_path=driver), options=options)
    yield chrome
    chrome.quit()


def wait_for(condition: Callable[[], Any], timeout: float = 30.0, what: str = "") -> Any:
    """Poll `condition` until it returns something truthy; fail naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


def console_errors(chrome) -> list[dict]:
    """The page's console messages at level SEVERE since the last call."""
    return [entry for entry in chrome.get_log("browser") if entry["level"] == "SEVERE"]
