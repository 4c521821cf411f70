"""The k3load tab in a real browser: headless Debian Chromium driven by Debian's chromium-driver through
selenium, against the web UI on loopback with the sim. Start a test from the UI, watch the tab's KV usage,
attempts and stage change, change the user count (a new stage manual-2), stop, see the verdict in the tab
and open the report, then start a second test and see a new run. Screenshots are kept under
runs/ci-report/ (webui-tab.png, webui-live.png) as CI artifacts.

Fails when the tab stops updating (attempts never grow, KV usage never shows) or a second test reuses a run.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.sim.test_report_browser import ARTIFACTS
from tests.webui_fixtures import web_ui_fixture  # noqa: F401  (the web_ui fixture)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
WAIT_S = 45


def _need(found: str | None, what: str) -> str:
    if found:
        return found
    if os.environ.get("CI"):
        pytest.fail(f"{what} is missing on CI: `make test` installs it first")
    pytest.skip(f"{what} is not installed here (make test installs it on Debian)")


@pytest.fixture
def driver(tmp_path) -> Iterator[Any]:
    browser = _need(shutil.which("chromium") or shutil.which("chromium-browser"), "chromium")
    chromedriver = _need(shutil.which("chromedriver"), "chromium-driver (chromedriver)")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        _need(None, "selenium (the dev extra)")
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--window-size=1400,2800",
                 f"--user-data-dir={tmp_path / 'chromium-profile'}"):
        options.add_argument(flag)
    chrome = webdriver.Chrome(service=Service(executable_path=chromedriver), options=options)
    chrome.set_page_load_timeout(30)
    try:
        yield chrome
    finally:
        chrome.quit()


def _until(what: str, check: Callable[[], Any], timeout_s: float = WAIT_S) -> Any:
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except Exception as exc:  # an element re-rendered under us: read it again
            last = exc
        if last and not isinstance(last, Exception):
            return last
        time.sleep(0.3)
    raise AssertionError(f"{what}: not seen within {timeout_s:.0f} s (last: {last!r})")


def _tab_rows(chrome: Any) -> dict[str, str]:
    from selenium.webdriver.common.by import By

    rows = {}
    for tr in chrome.find_elements(By.CSS_SELECTOR, "table tbody tr"):
        cells = [td.text for td in tr.find_elements(By.TAG_NAME, "td")]
        if len(cells) == 2:
            rows[cells[0]] = cells[1]
    return rows


def _click_text(chrome: Any, text: str, tag: str = "button") -> None:
    from selenium.webdriver.common.by import By

    buttons = _until(f"an enabled {tag} {text!r}", lambda: [  # MUI upper-cases labels on screen
        b for b in chrome.find_elements(By.TAG_NAME, tag) if b.text.strip().lower() == text.lower() and b.is_enabled()])
    buttons[0].click()


def _submit_users(chrome: Any, users: int, button: str) -> None:
    """Fill the open start/edit dialog's user count and press its button."""
    from selenium.webdriver.common.by import By

    field = _until("the user count field", lambda: chrome.find_element(By.CSS_SELECTOR, "input[name='userCount']"))
    field.send_keys("\ue009a")  # Ctrl+A
    field.send_keys(str(users))
    rate = chrome.find_elements(By.CSS_SELECTOR, "input[name='spawnRate']")
    if rate:
        rate[0].send_keys("\ue009a")
        rate[0].send_keys("10")
    _click_text(chrome, button)


def _open_tab(chrome: Any) -> None:
    from selenium.webdriver.common.by import By

    _until("the k3load tab", lambda: [t for t in chrome.find_elements(By.CSS_SELECTOR, "[role='tab']")
                                      if t.text.strip().lower() == "k3load"])[0].click()


def test_the_k3load_tab_follows_a_manual_ramp_and_each_test_is_its_own_run(web_ui, driver, tmp_path):
    from selenium.webdriver.common.by import By

    ui, _sim = web_ui("--k3-manual")
    driver.get(ui.base + "/")
    _submit_users(driver, 2, "Start")
    _open_tab(driver)
    assert "tab=k3load" in driver.current_url

    rows = _until("the tab's KV usage and stage manual-1", lambda: (r := _tab_rows(driver)) and
                  r.get("KV cache usage", "–").endswith("%") and r.get("stage", "").startswith("manual-1")
                  and "attempts (valid)" in r and r)  # all read in one pass of a table React may be redrawing
    first_run = rows["run"].split()[0]
    attempts = int(rows["attempts (valid)"].split()[0])
    _until("the tab updating (attempts growing)",
           lambda: int(_tab_rows(driver)["attempts (valid)"].split()[0]) > attempts)

    _click_text(driver, "Edit")  # change the user count while running: a new stage
    _submit_users(driver, 4, "Update")
    _until("stage manual-2 at 4 users in the tab", lambda: _tab_rows(driver).get("stage", "").startswith(
        "manual-2 (concurrency, 4 users)"))
    frame = _until("the live page under the tab's table", lambda: driver.find_element(By.ID, "k3load-live"))
    driver.switch_to.frame(frame)
    _until("the KV chart drawn", lambda: int(driver.find_element(By.ID, "c-kv").get_attribute("data-points")
                                            or 0) >= 2)
    driver.switch_to.default_content()

    _click_text(driver, "Stop")  # Locust stops refreshing its tables; the tab's live page shows the verdict
    driver.switch_to.frame(driver.find_element(By.ID, "k3load-live"))
    verdict = _until("the verdict in the tab", lambda: (v := driver.find_element(By.ID, "verdict"))
                     .get_attribute("class") in ("go", "limited", "scale_up", "rebuild") and v.text, 90)
    assert ":" in verdict  # the verdict and its reasons
    link = _until("the report link", lambda: driver.find_element(By.ID, "link-report-html"))
    report_url = link.get_attribute("href")
    driver.switch_to.default_content()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(ARTIFACTS / "webui-tab.png"))
    tab_url = driver.current_url
    driver.get(report_url)
    _until("the report opened", lambda: "k3load acceptance record" in driver.page_source)
    driver.get(ui.base + "/k3load/")
    _until("the live page's verdict", lambda: driver.find_element(By.ID, "verdict").get_attribute("class"))
    driver.save_screenshot(str(ARTIFACTS / "webui-live.png"))

    driver.get(tab_url)  # a second test from the UI: a new run
    _click_text(driver, "New")
    _submit_users(driver, 1, "Start")
    _open_tab(driver)
    rows = _until("a new run in the tab", lambda: (r := _tab_rows(driver)) and r.get("run", "").split()[0]
                  not in ("–", first_run) and r.get("stage", "").startswith("manual-1") and r)
    assert rows["verdict"].startswith("judged when the test stops")
    _click_text(driver, "Stop")
    state = ui.wait_for(lambda s: s["verdict"] is not None, 90, "the second verdict")
    assert state["run_id"] == rows["run"].split()[0] != first_run
    # the page's own start requests (its live options under the names it gives them) were never refused
    assert "web UI: refused" not in (tmp_path / "locust.log").read_text()
