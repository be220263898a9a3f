"""The owner console in a real browser: Debian's chromium, driven by Playwright.

vacancyd runs as a real subprocess (tests/support/daemon.py) in front of a real upstream
and a closed port; Playwright drives the system chromium (`executable_path`, never a
downloaded browser; tools/test.sh installs the package). Playwright's sync API runs in a
worker thread, so the trio loop keeps reading the daemon's log meanwhile. Every step waits
for what the page shows (Playwright's `expect` polls, bounded), never for a fixed time.

What the owner must be able to rely on: the page renders what /status says, a refusal's
reason appears, pause and snooze work and survive a reload, a held job can be released,
and from another machine the page asks once for a token, keeps it for the tab and asks
again when it is refused. A screenshot is kept with the test output and copied to
`test-artifacts/console.png` (ignored by git) for a person to look at.
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from playwright.sync_api import ConsoleMessage, Page, expect, sync_playwright

from tests.support.configs import daemon_config, upstream
from tests.support.daemon import daemon_process
from tests.support.plain_upstream import PlainUpstream
from vacancyd.admission import HOLDS_KIND
from vacancyd.persist import ensure_private_dir, write_json
from vacancyd.schedule import DAY_NAMES

# A real daemon and a real browser per test.
pytestmark = pytest.mark.slow

ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"
ALICE = "alice-0123456789abcdef"
VIEWER = "viewer-0123456789abcdef"
OWNER = "owner-fedcba9876543210"
WORK = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
# How long one expectation may wait: the page refreshes every 3 s.
WAIT_MS = 10_000
NOT_LOADED = "Failed to load resource: the server responded with a status of"


def sha256(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        pytest.fail("Debian's chromium package is needed; tools/test.sh installs it")
    return path


@contextmanager
def browser_page() -> Iterator[tuple[Page, list[str]]]:
    """A fresh headless chromium page, and the script errors and CSP violations it logs."""
    problems: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium(), headless=True)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.set_default_timeout(WAIT_MS)
            expect.set_options(timeout=WAIT_MS)
            page.on("pageerror", lambda error: problems.append(str(error)))
            page.on("console", lambda message: note(message, problems))
            yield page, problems
        finally:
            browser.close()


def note(message: ConsoleMessage, problems: list[str]) -> None:
    """Keep script errors and CSP violations; not the browser's note on each non-2xx
    answer (a 503 from /vacancy is the answer the console asks for)."""
    if message.type == "error" and not message.text.startswith(NOT_LOADED):
        problems.append(message.text)


async def in_browser(scenario: Callable[[Page], None]) -> list[str]:
    """Run `scenario` on a fresh page in a worker thread; returns the page's errors."""

    def run() -> list[str]:
        with browser_page() as (page, problems):
            scenario(page)
            return problems

    return await trio.to_thread.run_sync(run)


def keep_screenshot(page: Page, tmp_path: Path, name: str) -> None:
    shot = tmp_path / name
    page.screenshot(path=str(shot), full_page=True)
    ARTIFACTS.mkdir(exist_ok=True)
    shutil.copyfile(shot, ARTIFACTS / name)


def borrow(url: str, token: str | None = None) -> int:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with httpx.Client(trust_env=False, timeout=10) as http:
        return http.post(f"{url}/v1/chat/completions", json=WORK, headers=headers).status_code


# -- the owner at the machine ------------------------------------------------------------


def local_config(tmp_path: Path, plain: PlainUpstream) -> Path:
    state_dir = tmp_path / "state"
    ensure_private_dir(state_dir)
    # A job an earlier run could not prove stopped: it holds ram until the owner releases it.
    hold = {
        "job_id": 1,
        "upstream": "chat",
        "borrower": "alice",
        "resources": ["ram"],
        "model": "m",
        "job_ids": [],
        "reason": "chat may keep running the job after its connection was cut",
        "since": "2026-01-05T21:14:09+00:00",
    }
    write_json(state_dir / "holds.json", HOLDS_KIND, {"holds": [hold]})
    path = tmp_path / "vacancyd.toml"
    path.write_text(
        daemon_config(
            upstream("chat", plain.url),
            upstream("gone", "http://127.0.0.1:9"),
            state_dir=state_dir,
            auth={"tokens": [{"name": "alice", "scopes": ["borrow"], "sha256": sha256(ALICE)}]},
            owner={"lending_hours": [{"from": "00:00", "to": "24:00"}]},
        )
    )
    return path


async def test_the_console_shows_why_and_pauses_and_snoozes(
    plain: PlainUpstream, tmp_path: Path
) -> None:
    async with daemon_process(local_config(tmp_path, plain)) as daemon:
        api, chat, gone = daemon.api, daemon.proxies["chat"], daemon.proxies["gone"]

        def scenario(page: Page) -> None:
            page.goto(f"{api}/")
            lending = page.locator("#lending")
            expect(lending).to_have_text("Lending is on")
            expect(page.locator("#hours")).to_contain_text("every day 00:00\N{EN DASH}24:00")
            expect(page.locator("#hours")).to_contain_text("Now inside")
            # The restored hold refuses everything on ram, and says so; release it.
            expect(page.locator("#refusals")).to_contain_text("chat: job_held")
            held = page.locator("#work-chat li", has_text="held since")
            expect(held).to_contain_text("alice")
            keep_screenshot(page, tmp_path, "console-hold.png")
            held.get_by_role("button", name="Release hold").click()
            expect(page.locator("#work-chat")).to_have_count(0)
            expect(page.locator("#refusals")).to_contain_text("chat: takes work")

            # Two borrowers, and an upstream that does not answer at all.
            assert borrow(chat, ALICE) == 200
            assert borrow(chat) == 200
            assert borrow(gone, ALICE) == 502
            expect(page.locator("#borrower-alice")).to_be_visible()
            expect(page.locator("#borrower-local")).to_be_visible()
            expect(page.locator("#upstream-chat td").nth(1)).to_contain_text("yes")
            gone_answers = page.locator("#upstream-gone td").nth(1)
            expect(gone_answers).to_contain_text("no")
            expect(gone_answers).to_contain_text("ConnectError")
            expect(page.locator("#resource-ram")).to_contain_text("GiB")

            # A resource switch, and the refusal it causes.
            page.locator("#resource-ram").get_by_role("button", name="Switch off").click()
            expect(page.locator("#refusals")).to_contain_text("chat: resource_disabled")
            page.locator("#resource-ram").get_by_role("button", name="Switch on").click()
            expect(page.locator("#refusals")).to_contain_text("chat: takes work")

            # Pause: the reason appears, a borrower is refused for it, a reload keeps it.
            page.locator("#pause").click()
            expect(lending).to_have_text("Lending is paused")
            expect(page.locator("#refusals")).to_contain_text("chat: lending_disabled")
            assert borrow(chat, ALICE) == 503
            expect(page.locator("#borrower-alice")).to_contain_text("lending_disabled 1")
            page.reload()
            expect(lending).to_have_text("Lending is paused")
            expect(page.locator("#resume")).to_be_enabled()

            # Snooze for an hour: it says for how long, and a reload keeps it.
            page.locator("#snooze").get_by_role("button", name="1 h").click()
            expect(lending).to_have_text("Lending is paused for 1 h more")
            expect(page.locator("#lending-detail")).to_contain_text("resumes by itself")
            page.reload()
            expect(lending).to_contain_text("Lending is paused for")
            expect(page.locator("#refusals")).to_contain_text("lending_disabled")
            keep_screenshot(page, tmp_path, "console.png")

            page.locator("#resume").click()
            expect(lending).to_have_text("Lending is on")

        problems = await in_browser(scenario)
        async with httpx.AsyncClient(trust_env=False, timeout=10) as http:
            status = (await http.get(f"{api}/status")).json()
    assert problems == [], problems
    assert status["lending"]["enabled"] is True
    assert status["borrowers"]["alice"]["refused"] == {"lending_disabled": 1}
    assert (tmp_path / "console.png").stat().st_size > 10_000


# -- the owner from another machine --------------------------------------------------------


def token_config(tmp_path: Path, plain: PlainUpstream) -> Path:
    """Tokens only (loopback not trusted), and lending hours that are closed now: one
    minute the day after tomorrow."""
    closed_day = DAY_NAMES[(datetime.now(UTC).weekday() + 2) % 7]
    path = tmp_path / "vacancyd.toml"
    path.write_text(
        daemon_config(
            upstream("chat", plain.url),
            state_dir=tmp_path / "state",
            auth={
                "trust_loopback": False,
                "tokens": [
                    {"name": "viewer", "scopes": ["read"], "sha256": sha256(VIEWER)},
                    {"name": "owner", "scopes": ["read", "admin"], "sha256": sha256(OWNER)},
                ],
            },
            owner={
                "timezone": "Etc/UTC",
                "lending_hours": [{"days": [closed_day], "from": "00:00", "to": "00:01"}],
            },
        )
    )
    return path


async def test_the_console_asks_for_a_token_once_and_again_when_refused(
    plain: PlainUpstream, tmp_path: Path
) -> None:
    async with daemon_process(token_config(tmp_path, plain), read_token=VIEWER) as daemon:
        api = daemon.api

        def enter(page: Page, token: str) -> None:
            page.locator("#token-input").fill(token)
            page.locator("#token-submit").click()

        def scenario(page: Page) -> None:
            page.goto(f"{api}/")
            form = page.locator("#token-form")
            expect(form).to_be_visible()
            expect(page.locator("#token-why")).to_have_text(
                "This daemon needs a token to show its status."
            )
            expect(page.locator("#main")).to_be_hidden()
            keep_screenshot(page, tmp_path, "console-token.png")
            enter(page, "not-a-token")
            expect(page.locator("#token-why")).to_contain_text("did not accept that token")

            enter(page, VIEWER)
            closed = "Lending is on, but outside the lending hours"
            expect(page.locator("#lending")).to_have_text(closed)
            expect(page.locator("#refusals")).to_contain_text("chat: outside_lending_hours")
            expect(page.locator("#hours")).to_contain_text("Now outside; opens in")
            keep_screenshot(page, tmp_path, "console-remote.png")
            expect(form).to_be_hidden()
            stored: Any = page.evaluate("sessionStorage.getItem('vacancyd.token')")
            assert stored == VIEWER
            page.reload()  # kept for the tab: not asked again
            expect(page.locator("#lending")).to_have_text(closed)
            expect(form).to_be_hidden()

            # A read token cannot pause: the page says why and offers another token.
            page.locator("#pause").click()
            error = page.locator("#error")
            expect(error).to_contain_text("token 'viewer' lacks the admin scope")
            error.get_by_role("button", name="Use another token").click()
            expect(form).to_be_visible()
            enter(page, OWNER)
            expect(page.locator("#lending")).to_have_text(closed)
            page.locator("#pause").click()
            expect(page.locator("#lending")).to_have_text("Lending is paused")
            expect(error).to_be_hidden()

        problems = await in_browser(scenario)
        async with httpx.AsyncClient(trust_env=False, timeout=10) as http:
            anonymous = await http.get(f"{api}/status")
    assert problems == [], problems
    assert anonymous.status_code == 401


async def test_the_console_is_served_under_a_strict_content_security_policy(
    plain: PlainUpstream, tmp_path: Path
) -> None:
    async with (
        daemon_process(token_config(tmp_path, plain), read_token=VIEWER) as daemon,
        httpx.AsyncClient(trust_env=False, timeout=10) as http,
    ):
        page = await http.get(f"{daemon.api}/")
        script = await http.get(f"{daemon.api}/console/app.js")
        other = await http.get(f"{daemon.api}/console/..%2fstatus.py")
    assert page.status_code == 200 and script.status_code == 200
    assert script.headers["content-type"].startswith("text/javascript")
    policy = page.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "frame-ancestors 'none'" in policy
    assert "<script" in page.text and "<script>" not in page.text, "no inline script"
    assert other.status_code == 404
