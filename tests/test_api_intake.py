"""vacancyd.api.intake on its own: the header rules, and the render slots' bound.

The wire tests (test_api_cross_site.py, test_api_load.py) show the rules and the bound at
work in a daemon; these pin down the edges exactly. The slots run on trio's MockClock, so
"turned away after RENDER_WAIT_S" is checked to the tick rather than by waiting for it.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from vacancyd.api.intake import (
    CROSS_SITE,
    NOT_JSON,
    RenderSlots,
    cross_site_refusal,
    is_json,
    is_own_origin,
)

HOST = "127.0.0.1:9460"
JSON = ["application/json"]


@pytest.mark.parametrize(
    ("content_types", "json"),
    [
        (["application/json"], True),
        (["APPLICATION/Json"], True),
        (["application/json; charset=utf-8"], True),
        (["application/json;charset=UTF-8"], True),
        ([" application/json "], True),
        ([], False),
        ([""], False),
        (["text/plain"], False),
        (["text/plain;charset=UTF-8"], False),
        (["application/x-www-form-urlencoded"], False),
        (["multipart/form-data; boundary=x"], False),
        (["application/json-patch+json"], False),
        (["application/jsonx"], False),
        (["application/json", "application/json"], False),
        (["text/plain; application/json"], False),
    ],
)
def test_only_one_application_json_content_type_is_json(
    content_types: list[str], json: bool
) -> None:
    assert is_json(content_types) is json


@pytest.mark.parametrize(
    ("origin", "host", "own"),
    [
        ("http://127.0.0.1:9460", HOST, True),
        ("HTTP://127.0.0.1:9460", HOST, True),
        ("https://127.0.0.1:9460", HOST, True),  # behind a TLS terminator passing Host on
        ("http://[::1]:9460", "[::1]:9460", True),
        ("http://localhost:9460", "localhost:9460", True),
        ("http://127.0.0.1:9461", HOST, False),  # same site, another origin
        ("http://127.0.0.1", HOST, False),
        ("http://localhost:9460", HOST, False),
        ("http://evil.example", HOST, False),
        ("null", HOST, False),
        ("", HOST, False),
        ("http://127.0.0.1:9460", None, False),
        ("http://127.0.0.1:9460/", HOST, False),
    ],
)
def test_an_origin_is_ours_only_when_it_names_the_host_we_were_called_by(
    origin: str, host: str | None, own: bool
) -> None:
    assert is_own_origin(origin, host) is own


@pytest.mark.parametrize("method", ["GET", "HEAD", "OPTIONS", "get"])
def test_reads_are_never_refused(method: str) -> None:
    assert cross_site_refusal(method, ["null"], ["cross-site"], [], HOST) is None


@pytest.mark.parametrize("method", ["POST", "PUT", "PATCH", "DELETE", "post", "PROPFIND"])
def test_anything_else_must_be_json_from_here(method: str) -> None:
    assert cross_site_refusal(method, [], [], JSON, HOST) is None
    assert cross_site_refusal(method, [], [], ["text/plain"], HOST) is NOT_JSON
    assert cross_site_refusal(method, [], [], [], HOST) is NOT_JSON
    assert cross_site_refusal(method, ["http://evil.example"], [], JSON, HOST) is CROSS_SITE


@pytest.mark.parametrize(
    ("origins", "sites", "refused"),
    [
        ([f"http://{HOST}"], ["same-origin"], False),
        ([], ["none"], False),  # typed, bookmarked: the owner's own doing
        ([], ["Same-Origin"], False),
        ([], ["same-site"], True),
        ([], ["cross-site"], True),
        ([], ["bogus"], True),
        ([f"http://{HOST}"], ["cross-site"], True),
        (["null"], ["same-origin"], True),
        ([f"http://{HOST}", "http://evil.example"], [], True),
        ([], ["same-origin", "cross-site"], True),
    ],
)
def test_where_a_browser_says_a_request_came_from_decides_before_its_type(
    origins: list[str], sites: list[str], refused: bool
) -> None:
    # Even a body that is not JSON is refused as cross-site first: the browser said so.
    expected = CROSS_SITE if refused else None
    assert cross_site_refusal("POST", origins, sites, JSON, HOST) is expected
    if refused:
        assert cross_site_refusal("POST", origins, sites, ["text/plain"], HOST) is CROSS_SITE


async def test_render_slots_let_a_few_in_and_turn_the_rest_away_after_the_wait(
    autojump_clock: trio.testing.MockClock,
) -> None:
    slots = RenderSlots(2, wait_s=1.0)
    release = trio.Event()
    inside = 0
    most_inside = 0
    outcomes: list[tuple[int, bool, float]] = []  # (reader, got a slot, seconds waited)

    async def reader(index: int) -> None:
        nonlocal inside, most_inside
        started = trio.current_time()
        async with slots.slot() as got:
            outcomes.append((index, got, trio.current_time() - started))
            if got:
                inside += 1
                most_inside = max(most_inside, inside)
                await release.wait()
                inside -= 1

    async with trio.open_nursery() as nursery:
        for index in range(4):
            nursery.start_soon(reader, index)
        await trio.sleep(2.0)  # (mock time) past every waiter's patience
        release.set()
    assert most_inside == 2
    # Which two get in is trio's scheduling; that two do, at once, and two wait the full
    # second and are turned away, is the bound.
    assert sorted((got, waited) for _, got, waited in outcomes) == [
        (False, 1.0),
        (False, 1.0),
        (True, 0.0),
        (True, 0.0),
    ]

    # Turned-away readers held nothing: both slots are free again, at once.
    async with slots.slot() as first, slots.slot() as second:
        assert first and second


async def test_a_waiting_reader_gets_the_slot_that_frees_within_the_wait(
    autojump_clock: trio.testing.MockClock,
) -> None:
    slots = RenderSlots(1, wait_s=1.0)
    got_at: list[float] = []

    async def holder(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with slots.slot() as got:
            assert got
            task_status.started()
            await trio.sleep(0.5)

    async def waiter() -> None:
        async with slots.slot() as got:
            assert got
            got_at.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        start = trio.current_time()
        await nursery.start(holder)
        nursery.start_soon(waiter)
    assert got_at == [start + 0.5]
