"""The page for tenants and finance in a real browser (Debian's chromium and chromedriver,
driven headless by selenium) against admission on a known ledger: it loads after signing in,
shows the ledger's figures, refuses a reader limited to another tenant what is not theirs, and
works from the keyboard alone (the skip link, Tab to a link and Enter to follow it)."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from budgetgate.core.principals import Role
from tests.support.known_ledger import ACCOUNTS, BUDGETS, write_known_ledger
from tests.support.principals import issue

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1280,1024",
)

pytest.importorskip("selenium", reason="selenium is missing: install the dev extra (`pip install -e '.[dev]'`) to run the browser test")
pytestmark = pytest.mark.skipif(
    not (CHROMIUM.exists() and CHROMEDRIVER.exists()),
    reason=f"{CHROMIUM} or {CHROMEDRIVER} is missing: `apt-get install chromium chromium-driver` to run the browser test",
)


@contextmanager
def chromium() -> Iterator[object]:
    """A headless Chromium of its own (a fresh profile), closed afterwards."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="budgetgate-ui-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (*FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def press(driver, *keys: str) -> None:  # type: ignore[no-untyped-def]
    from selenium.webdriver.common.action_chains import ActionChains

    ActionChains(driver).send_keys(*keys).perform()


def focused(driver):  # type: ignore[no-untyped-def]
    return driver.switch_to.active_element


def tab_to(driver, wanted, *, at_most: int = 200):  # type: ignore[no-untyped-def]
    """Press Tab until `wanted(focused element)` holds; the element, or a failure naming the last one."""
    from selenium.webdriver.common.keys import Keys

    for _ in range(at_most):
        press(driver, Keys.TAB)
        element = focused(driver)
        if wanted(element):
            return element
    raise AssertionError(f"{at_most} Tabs never reached the element wanted; the last focused was {element.get_attribute('outerHTML')[:200]}")


def wait_for_title(driver, text: str) -> None:  # type: ignore[no-untyped-def]
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, 20).until(lambda d: text in d.title, f"a page titled {text!r}; got {driver.title!r} at {driver.current_url}")


def sign_in_by_keyboard(driver, url: str, token: str) -> None:  # type: ignore[no-untyped-def]
    """From the page's address: sent to sign in, then the skip link, the token and Enter, by keyboard only."""
    from selenium.webdriver.common.keys import Keys

    driver.get(f"{url}/ui")
    wait_for_title(driver, "Sign in")
    assert "/ui/sign-in?next=/ui" in driver.current_url, driver.current_url
    press(driver, Keys.TAB)
    skip = focused(driver)
    assert skip.text == "Skip to main content" and skip.get_attribute("href").endswith("#main"), skip.get_attribute("outerHTML")
    press(driver, Keys.ENTER)
    assert driver.current_url.endswith("#main") and focused(driver).get_attribute("id") == "main", focused(driver).get_attribute("outerHTML")[:80]
    field = tab_to(driver, lambda e: e.get_attribute("id") == "token", at_most=5)
    assert field.get_attribute("type") == "password"
    press(driver, token, Keys.ENTER)
    wait_for_title(driver, "Budgets and chargeback")


def figure(driver, policy: str, name: str) -> float:  # type: ignore[no-untyped-def]
    from selenium.webdriver.common.by import By

    cell = driver.find_element(By.CSS_SELECTOR, f'article[id="budget-{policy}"] td[data-figure="{name}"]')
    return float(cell.text.replace(",", ""))


def account_row(driver, account: str) -> list[float]:  # type: ignore[no-untyped-def]
    from selenium.webdriver.common.by import By

    cells = driver.find_elements(By.CSS_SELECTOR, f'tr[data-account="{account}"] td.num')
    return [float(c.text.replace(",", "")) for c in cells]


def reader_session(url: str, reader: str, nlp_reader: str) -> None:
    """Every browser check, in one Chromium (run in a thread: the server shares the test's loop)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    with chromium() as driver:
        sign_in_by_keyboard(driver, url, reader)
        assert driver.find_element(By.TAG_NAME, "h1").text.startswith("Budgets and chargeback")
        for policy, (consumed, limit, reserved) in BUDGETS.items():
            assert (figure(driver, policy, "consumed"), figure(driver, policy, "limit"), figure(driver, policy, "reserved")) == (consumed, limit, reserved)
            chart = driver.find_element(By.CSS_SELECTOR, f'article[id="budget-{policy}"] svg[role="img"]')
            described = chart.find_element(By.TAG_NAME, "desc").get_attribute("textContent")
            assert f"Used {consumed:,.3f} of {limit:,.3f} GPU-hours" in described, described
        for account, figures in ACCOUNTS.items():
            assert account_row(driver, account)[:3] == list(figures), account

        # Tab to an in-page link and follow it with Enter; then on to a decision, and follow that.
        driver.find_element(By.TAG_NAME, "body").click()
        driver.get(f"{url}/ui")
        link = tab_to(driver, lambda e: (e.get_attribute("href") or "").endswith("#decisions"))
        press(driver, Keys.ENTER)
        assert driver.current_url.endswith("#decisions"), driver.current_url
        link = tab_to(driver, lambda e: (e.get_attribute("href") or "").endswith("/ui/decisions/ui%2Fvision-1"))
        assert link.text == "ui/vision-1"
        press(driver, Keys.ENTER)
        wait_for_title(driver, "Decision of ui/vision-1")
        steps = driver.find_elements(By.CSS_SELECTOR, "#explanation li")
        assert steps and "ui/vision-1" in steps[0].text, [s.text for s in steps]

        # Sign out with the keyboard: the page is then out of reach again.
        button = tab_to(driver, lambda e: e.tag_name == "button" and e.text == "Sign out", at_most=10)
        press(driver, Keys.ENTER)
        wait_for_title(driver, "Sign in")
        assert "You are signed out." in driver.page_source and button is not None
        driver.get(f"{url}/ui")
        wait_for_title(driver, "Sign in")

        # A reader limited to tenant nlp: its budget and account, not vision's; vision's decision refused.
        sign_in_by_keyboard(driver, url, nlp_reader)
        assert driver.find_elements(By.CSS_SELECTOR, 'article[id="budget-gpu/nlp"]')
        assert not driver.find_elements(By.CSS_SELECTOR, 'article[id="budget-gpu/vision"]')
        assert not driver.find_elements(By.CSS_SELECTOR, 'tr[data-account="vision"]')
        assert account_row(driver, "nlp")[:3] == list(ACCOUNTS["nlp"])
        assert "ui/vision-1" not in driver.page_source
        driver.get(f"{url}/ui/decisions/ui%2Fvision-1")
        wait_for_title(driver, "Not allowed")
        assert "is not allowed tenant 'vision'" in driver.find_element(By.CSS_SELECTOR, "[role=alert]").text
        driver.get(f"{url}/ui?tenant=vision")
        wait_for_title(driver, "Not allowed")


async def test_the_page_in_a_browser(admission_factory, pg_dsn) -> None:
    await write_known_ledger(pg_dsn)
    server = await admission_factory()
    await server.wait_ready()
    reader = await issue(pg_dsn, Role.READER)
    nlp_reader = await issue(pg_dsn, Role.READER, tenants=["nlp"])
    await asyncio.to_thread(reader_session, server.url, reader, nlp_reader)
