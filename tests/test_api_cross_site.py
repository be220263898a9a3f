"""No page on another site can change anything through the owner's browser.

The API trusts loopback callers, and the owner's browser is one. A page it opens on any
other site can send a POST to 127.0.0.1:9460 without a CORS preflight as long as the body
is absent, a form or text/plain: a `<form method=POST>`, or `fetch(url, {method: "POST",
mode: "no-cors"})`. So every request that changes something must say it is JSON (which
such a page cannot send) and must not come from another origin (Origin, Sec-Fetch-Site).

Two views of it:

* over the wire, every state-changing route of the API app (found by walking the app's
  URL map, so a route added later is walked too) gets the requests such a page can make,
  and nothing changes: the durable hold is still held, the untrusted holds file still
  refused, lending and the resource still on, the debug window still closed. The same
  routes then act on the same bodies sent as the console sends them, so the refusals are
  not refusals of a body that would have been refused anyway;
* in Debian's chromium (as tests/test_console.py drives it), a page served from another
  loopback port forges form posts and no-cors fetches at a real daemon subprocess, and
  again nothing changes.

The daemon's app is built inside run_daemon and not handed out, so the walk reads the URL
map of an app built by the same factory with every optional part the service passes
(operator tools, admission): which routes exist depends only on those.
"""

from __future__ import annotations

import html
import logging
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from playwright.sync_api import Response as PageResponse
from playwright.sync_api import sync_playwright

from tests.support.configs import one_upstream_config
from tests.support.daemon import InProcessDaemon, daemon_process, in_process_daemon
from tests.support.plain_upstream import PlainUpstream
from tests.support.upstreams import EchoUpstream
from tests.test_console import chromium
from vacancyd.admission import HOLDS_KIND, Admission, Ledger
from vacancyd.api.app import create_api_app
from vacancyd.api.parts import DaemonParts
from vacancyd.auth import Authenticator
from vacancyd.cli import main
from vacancyd.decisions import DecisionLog
from vacancyd.operations import Operations
from vacancyd.persist import ensure_private_dir, write_json

# The hold's id in the file; the daemon numbers restored holds afresh (from a counter the
# whole test process shares), so the id to release is read from /status.
HOLD = {
    "job_id": 1,
    "upstream": "echo",
    "borrower": "alice",
    "resources": ["ram"],
    "model": "m",
    "job_ids": [],
    "reason": "echo may keep running the job after its connection was cut",
    "since": "2026-01-05T21:14:09+00:00",
}
# What fills each path parameter, but for the hold's id: the configured resource.
PATH_VALUES: dict[str, Any] = {"name": "ram"}
# A body each route acts on when it is sent as the console sends it; `{}` for the rest.
ACTING_BODIES: dict[str, dict[str, Any]] = {
    "/admin/lending": {"enabled": False},
    "/admin/resources/<name>": {"enabled": False},
    "/admin/debug": {"for_s": 600},
}
EVIL = "http://evil.example"
# Methods that change nothing; every other one a route takes is walked.
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
WAIT_S = 15.0


def holds_file(state_dir: Path, *, readable: bool) -> Path:
    """A holds file as a previous run left it: one hold on ram, or one cut off mid-write
    (which the daemon refuses to trust, holding every resource until it is cleared)."""
    ensure_private_dir(state_dir)
    path = state_dir / "holds.json"
    if readable:
        write_json(path, HOLDS_KIND, {"holds": [HOLD]})
    else:
        path.write_bytes(b'{"vacancyd_state": "holds", "version": 1, "data": {"holds": [')
        path.chmod(0o600)
    return path


@contextmanager
def levels_kept() -> Iterator[None]:
    """The debug window the acting requests open changes logger levels; put them back."""
    names = ("vacancyd", "httpx", "httpcore")
    saved = {name: logging.getLogger(name).level for name in names}
    try:
        yield
    finally:
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)


def state_changing_routes(
    daemon: InProcessDaemon, hold_id: int
) -> list[tuple[str, str, dict[str, Any]]]:
    """(method, path, acting body) for every route of the API app that takes a method
    other than GET, HEAD or OPTIONS, path parameters filled in (`hold_id` for a job)."""
    state = daemon.state
    ledger = Ledger(state)
    decisions = DecisionLog([upstream.name for upstream in state.config.upstream])
    app = create_api_app(
        DaemonParts(
            state=state,
            published=daemon.published,
            ledger=ledger,
            decisions=decisions,
            auth=Authenticator(state.config.auth),
            operator=Operations(state.config, {}).tools(None),
            admission=Admission(state, ledger, decisions),
        )
    )
    adapter = app.url_map.bind("127.0.0.1")
    routes = []
    for rule in app.url_map.iter_rules():
        methods = sorted(set(rule.methods or ()) - SAFE_METHODS)
        if not methods:
            continue
        values = {**PATH_VALUES, "job_id": hold_id}
        unknown = set(rule.arguments) - set(values)
        assert not unknown, f"{rule.rule}: add a value for {unknown} to PATH_VALUES"
        path = adapter.build(rule.endpoint, {name: values[name] for name in rule.arguments})
        routes.extend((method, path, ACTING_BODIES.get(rule.rule, {})) for method in methods)
    return routes


def forgeries(body: bytes, api: str) -> list[tuple[str, dict[str, str], bytes]]:
    """(what, headers, body) a page on another site could get a browser to send, or that
    a browser sends for such a page, with the body that would act sent as JSON where the
    point is the origin rather than the type."""
    port = api.rsplit(":", 1)[1]
    json_type = {"Content-Type": "application/json"}
    return [
        ("form", {"Content-Type": "application/x-www-form-urlencoded"}, b"enabled=false"),
        ("multipart", {"Content-Type": "multipart/form-data; boundary=x"}, b"--x--\r\n"),
        ("text/plain", {"Content-Type": "text/plain;charset=UTF-8"}, body),
        ("no type", {}, body),
        ("no body", {}, b""),
        ("json-ish", {"Content-Type": "application/json-patch+json"}, body),
        ("two types", {"Content-Type": "application/json, text/plain"}, body),
        ("other origin", {**json_type, "Origin": EVIL}, body),
        ("null origin", {**json_type, "Origin": "null"}, body),
        ("other port", {**json_type, "Origin": f"http://127.0.0.1:{int(port) + 1}"}, body),
        ("cross-site fetch", {**json_type, "Sec-Fetch-Site": "cross-site"}, body),
        ("same-site fetch", {**json_type, "Sec-Fetch-Site": "same-site"}, body),
        ("form from elsewhere", {"Content-Type": "text/plain", "Origin": EVIL}, body),
    ]


async def what_could_change(http: httpx.AsyncClient, api: str) -> dict[str, Any]:
    """Everything a forged request could change, as /status shows it."""
    status = (await http.get(f"{api}/status")).json()
    return {
        "lending": status["lending"]["enabled"],
        "ram": status["resources"]["ram"]["enabled"],
        "debug": status["debug_logging"]["active"],
        "held": [
            job["job_id"]
            for job in status["upstreams"]["echo"]["active_work"]
            if job["phase"] == "held"
        ],
        "untrusted": [problem["kind"] for problem in status["state_files"]],
    }


@asynccontextmanager
async def daemon_with_holds(
    echo: EchoUpstream, tmp_path: Path, *, readable: bool
) -> AsyncIterator[tuple[InProcessDaemon, httpx.AsyncClient]]:
    state_dir = tmp_path / "state"
    holds_file(state_dir, readable=readable)
    async with (
        in_process_daemon(one_upstream_config(echo.url, state_dir)) as daemon,
        httpx.AsyncClient(trust_env=False, timeout=WAIT_S) as http,
    ):
        yield daemon, http


@pytest.mark.parametrize("readable", [True, False], ids=["held", "untrusted-file"])
async def test_no_state_changing_route_acts_on_what_another_site_can_send(
    echo: EchoUpstream, tmp_path: Path, readable: bool
) -> None:
    with levels_kept():
        async with daemon_with_holds(echo, tmp_path, readable=readable) as (daemon, http):
            before = await what_could_change(http, daemon.api)
            hold_id = before["held"][0] if readable else 1
            assert before == {
                "lending": True,
                "ram": True,
                "debug": False,
                "held": [hold_id] if readable else [],
                "untrusted": [] if readable else ["holds"],
            }
            routes = state_changing_routes(daemon, hold_id)
            walked = {path for _, path, _ in routes}
            assert {
                "/admin/lending",
                "/admin/resources/ram",
                f"/admin/holds/{hold_id}/release",
                "/admin/holds/unreadable/clear",
                "/admin/debug",
            } <= walked

            # Nothing may change, whatever the answer; the answers are checked after.
            wrong: list[tuple[str, str, int, str]] = []
            for method, path, acting in routes:
                body = httpx.Request("POST", "/", json=acting).content
                for what, headers, content in forgeries(body, daemon.api):
                    answer = await http.request(
                        method, f"{daemon.api}{path}", headers=headers, content=content
                    )
                    assert await what_could_change(http, daemon.api) == before, (path, what)
                    expected = (
                        (403, "cross_origin_refused")
                        if "Origin" in headers or "Sec-Fetch-Site" in headers
                        else (415, "json_required")
                    )
                    error = answer.json().get("error", {})
                    closes = not content or answer.headers.get("connection") == "close"
                    got = (answer.status_code, error.get("code"))
                    if got != expected or error.get("type") != "api_error" or not closes:
                        wrong.append((path, what, *got))
            assert wrong == []

            # The same bodies, sent as the console and the command line send them, act.
            own = {"Origin": daemon.api, "Sec-Fetch-Site": "same-origin"}
            for method, path, acting in routes:
                headers = own if "lending" in path else {}
                answer = await http.request(
                    method, f"{daemon.api}{path}", json=acting, headers=headers
                )
                assert answer.status_code in (200, 404), (path, answer.text)
            after = await what_could_change(http, daemon.api)
            assert after == {
                "lending": False,
                "ram": False,
                "debug": True,
                "held": [],
                "untrusted": [],
            }
            await http.post(f"{daemon.api}/admin/debug", json={"for_s": 0})


@pytest.mark.parametrize(
    "content_type",
    ["application/json", "Application/JSON", "application/json; charset=utf-8"],
)
async def test_json_is_json_in_any_case_and_with_a_charset(
    echo: EchoUpstream, tmp_path: Path, content_type: str
) -> None:
    async with daemon_with_holds(echo, tmp_path, readable=True) as (daemon, http):
        answer = await http.post(
            f"{daemon.api}/admin/lending",
            content=b'{"enabled": false}',
            headers={"Content-Type": content_type, "Sec-Fetch-Site": "none"},
        )
        assert answer.status_code == 200, answer.text
        assert not daemon.state.lending_enabled


async def test_the_command_line_still_releases_and_pauses(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    """`vacancyd release` sends a POST with nothing to say, and `pause` one with a body:
    both go as JSON now, or the API would refuse them."""

    def cli(*argv: str) -> int:
        return main(list(argv))

    async with daemon_with_holds(echo, tmp_path, readable=True) as (daemon, http):
        [hold_id] = (await what_could_change(http, daemon.api))["held"]
        code = await trio.to_thread.run_sync(cli, "release", str(hold_id), "--api", daemon.api)
        assert code == 0
        code = await trio.to_thread.run_sync(cli, "pause", "--api", daemon.api)
        assert code == 0
        after = await what_could_change(http, daemon.api)
    assert (after["held"], after["lending"]) == ([], False)


# -- in a real browser -----------------------------------------------------------------------

ATTACK_PAGE = """<!doctype html>
<title>cute cats</title>
<pre id="log"></pre>
{forms}
<script>
const api = {api!r};
const log = (line) => {{ document.getElementById("log").textContent += line + "\\n"; }};
const sent = (what, promise) => promise.then(
  () => log(what + ": answered"), (error) => log(what + ": failed " + error));

async function forge() {{
  const json = {{"Content-Type": "application/json"}};
  const noCors = (path, body, headers) =>
    fetch(api + path, {{method: "POST", mode: "no-cors", body, headers: headers || {{}}}});
  await sent("no-cors release", noCors("/admin/holds/{hold}/release"));
  await sent("no-cors release {{}}", noCors("/admin/holds/{hold}/release", "{{}}"));
  await sent("no-cors clear", noCors("/admin/holds/unreadable/clear", "{{}}"));
  await sent("no-cors pause", noCors("/admin/lending", '{{"enabled": false}}'));
  // no-cors drops a Content-Type it may not send: this goes as text/plain.
  await sent("no-cors pause as json", noCors("/admin/lending", '{{"enabled": false}}', json));
  await sent("no-cors resource", noCors("/admin/resources/ram", '{{"enabled": false}}'));
  await sent("no-cors debug", noCors("/admin/debug", '{{"for_s": 600}}'));
  // A real JSON post needs a preflight, which the daemon never approves.
  await sent("cors pause", fetch(api + "/admin/lending",
    {{method: "POST", headers: json, body: '{{"enabled": false}}'}}));
  for (const form of document.forms) {{
    const frame = document.getElementById(form.target);
    await new Promise((done) => {{
      frame.addEventListener("load", done, {{once: true}});
      form.submit();
    }});
    log("form " + form.id + ": loaded");
  }}
  log("done");
}}
forge();
</script>
"""

# Form posts: url-encoded with nothing in them (a release), and text/plain with a field
# named so that the body reads as JSON (the classic trick against JSON-only endpoints).
FORMS = [
    ("release", "/admin/holds/{hold}/release", "application/x-www-form-urlencoded", "", ""),
    ("clear", "/admin/holds/unreadable/clear", "application/x-www-form-urlencoded", "", ""),
    ("pause", "/admin/lending", "text/plain", '{"enabled": false, "x": "', '"}'),
    ("resource", "/admin/resources/ram", "text/plain", '{"enabled": false, "x": "', '"}'),
    ("debug", "/admin/debug", "text/plain", '{"for_s": 600, "x": "', '"}'),
]


def attack_page(api: str, hold_id: int) -> bytes:
    forms = []
    for name, path, enctype, field, value in FORMS:
        action = html.escape(api + path.format(hold=hold_id))
        hidden = (
            f'<input type="hidden" name="{html.escape(field)}" value="{html.escape(value)}">'
            if field
            else ""
        )
        forms.append(
            f'<iframe name="sink-{name}" id="sink-{name}"></iframe>'
            f'<form id="{name}" method="POST" action="{action}" enctype="{enctype}" '
            f'target="sink-{name}">{hidden}</form>'
        )
    return ATTACK_PAGE.format(api=api, hold=hold_id, forms="\n".join(forms)).encode()


@contextmanager
def other_site(page: bytes) -> Iterator[str]:
    """A stdlib server on another loopback port serving one page: another origin (and,
    as browsers count sites, the same site, which must not matter)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def browser_config(tmp_path: Path, upstream_url: str, *, readable: bool) -> Path:
    state_dir = tmp_path / "state"
    holds_file(state_dir, readable=readable)
    path = tmp_path / "vacancyd.toml"
    path.write_text(one_upstream_config(upstream_url, state_dir))
    return path


def forge_in_browser(attacker: str, api: str) -> tuple[str, list[tuple[str, int]]]:
    """Open the attacking page and let it run; what it logged, and every answer the API
    gave it (method and status), seen from the browser's side."""
    answers: list[tuple[str, int]] = []

    def seen(response: PageResponse) -> None:
        if response.url.startswith(api):
            answers.append((response.request.method, response.status))

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium(), headless=True)
        try:
            page = browser.new_page()
            page.set_default_timeout(WAIT_S * 1000)
            page.on("response", seen)
            page.goto(attacker)
            page.wait_for_function("document.getElementById('log').textContent.includes('done')")
            log = page.locator("#log").text_content() or ""
        finally:
            browser.close()
    return log, answers


@pytest.mark.slow
@pytest.mark.parametrize("readable", [True, False], ids=["held", "untrusted-file"])
async def test_a_page_on_another_origin_changes_nothing_in_chromium(
    plain: PlainUpstream, tmp_path: Path, readable: bool
) -> None:
    config = browser_config(tmp_path, plain.url, readable=readable)
    async with (
        daemon_process(config) as daemon,
        httpx.AsyncClient(trust_env=False, timeout=WAIT_S) as http,
    ):
        before = await what_could_change(http, daemon.api)
        assert len(before["held"]) == (1 if readable else 0)
        assert before["untrusted"] == ([] if readable else ["holds"])
        hold_id = before["held"][0] if readable else 1
        with other_site(attack_page(daemon.api, hold_id)) as attacker:
            log, answers = await trio.to_thread.run_sync(forge_in_browser, attacker, daemon.api)
        after = await what_could_change(http, daemon.api)

    # Every forgery reached the daemon and was answered (a no-cors fetch that got no
    # answer would have failed), except the JSON post the browser would not send
    # without an approved preflight ...
    lines = log.splitlines()
    assert [line for line in lines if line.endswith("answered")] == [
        "no-cors release: answered",
        "no-cors release {}: answered",
        "no-cors clear: answered",
        "no-cors pause: answered",
        "no-cors pause as json: answered",
        "no-cors resource: answered",
        "no-cors debug: answered",
    ], log
    assert any(line.startswith("cors pause: failed") for line in lines), log
    assert [line for line in lines if line.startswith("form ")] == [
        f"form {name}: loaded" for name, *_ in FORMS
    ], log
    # ... refused as coming from another site, every one of them ...
    posts = [status for method, status in answers if method == "POST"]
    assert posts == [403] * (7 + len(FORMS)), answers
    # ... and nothing changed.
    assert after == before
