"""The real openai SDK, with its default settings, against vacancyd.

Before the retry stance, a default client slept Retry-After and retried twice whenever it
was at most 120 s: 240 s of silence while the owner was present, and a request cut by the
owner's return "succeeded" minutes later. Now every refusal but a busy slot says
`x-should-retry: false`, so the SDK raises at once with the reason in `.code`, and the
server sees exactly one attempt. Forwarded answers stay what the server itself gives.

The SDK is synchronous; it runs in worker threads while the daemon serves in-process.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import openai
import pytest
import trio

from tests.support.clients import attempts, in_thread, lender_config, owner_returns
from tests.support.daemon import InProcessDaemon, in_process_daemon
from tests.support.upstreams import EchoUpstream

pytestmark = pytest.mark.e2e

MODEL = "gemma3-270m"
HELLO = [{"role": "user", "content": "Count to ten."}]


def sdk(base: str) -> openai.OpenAI:
    """A client as a user makes one: default retries and timeouts."""
    return openai.OpenAI(base_url=f"{base}/v1", api_key="sk-borrower")


@pytest.fixture
async def lender(llama_url: str, tmp_path: Path) -> AsyncIterator[InProcessDaemon]:
    async with in_process_daemon(lender_config(llama_url, tmp_path / "state")) as daemon:
        yield daemon


def pause(daemon: InProcessDaemon) -> None:
    daemon.state.set_lending(False)


def switch_off_ram(daemon: InProcessDaemon) -> None:
    daemon.state.set_resource_switch("ram", False)


@pytest.mark.parametrize(
    ("refuse", "reason", "retry_after"),
    [
        (pause, "lending_disabled", "300"),
        (owner_returns, "owner_active", "120"),
        (switch_off_ram, "resource_disabled", "300"),
    ],
)
async def test_a_refusal_raises_at_once_with_its_reason_and_one_attempt(
    lender: InProcessDaemon,
    refuse: Callable[[InProcessDaemon], None],
    reason: str,
    retry_after: str,
) -> None:
    refuse(lender)
    client = sdk(lender.proxy("lender"))

    def ask() -> tuple[openai.APIStatusError, float]:
        started = time.monotonic()
        try:
            client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4)
        except openai.APIStatusError as exc:
            return exc, time.monotonic() - started
        raise AssertionError("the request was not refused")

    error, took = await in_thread(ask)
    assert isinstance(error, openai.InternalServerError)
    assert error.status_code == 503
    assert (error.type, error.code) == ("no_vacancy", reason)
    assert error.response.headers["retry-after"] == retry_after
    assert error.response.headers["x-vacancyd-reason"] == reason
    assert error.response.headers["x-should-retry"] == "false"
    assert took < 1.0, f"raised after {took:.2f}s"
    assert await attempts(lender, "lender") == 1


async def test_insufficient_capacity_raises_at_once(echo: EchoUpstream, tmp_path: Path) -> None:
    """A generic OpenAI server proves no residency, so its footprint is always charged."""
    too_big = "default_need_mib = { ram = 100000000 }"
    config = lender_config(echo.url, tmp_path / "state", adapter="openai", upstream_extra=too_big)
    async with in_process_daemon(config) as daemon:
        client = sdk(daemon.proxy("lender"))

        def ask() -> openai.APIStatusError:
            with pytest.raises(openai.APIStatusError) as raised:
                client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4)
            return raised.value

        started = trio.current_time()
        error = await in_thread(ask)
        assert trio.current_time() - started < 1.0
        assert (error.status_code, error.code) == (503, "insufficient_capacity")
        assert await attempts(daemon, "lender") == 1


@pytest.mark.parametrize(("retry_in_place", "expected_attempts"), [("", 3), ("[]", 1)])
async def test_a_busy_slot_is_retried_in_place_only_where_configured(
    echo: EchoUpstream, tmp_path: Path, retry_in_place: str, expected_attempts: int
) -> None:
    """By default `resource_busy` says x-should-retry: true, and the SDK retries twice,
    2 s apart (Retry-After); with retry_in_place = [] it raises after one attempt."""
    extra = f"retry_in_place = {retry_in_place}" if retry_in_place else ""
    config = lender_config(echo.url, tmp_path / "state", adapter="openai", upstream_extra=extra)
    async with in_process_daemon(config) as daemon, trio.open_nursery() as nursery:
        base = daemon.proxy("lender")
        holder = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)

        def hold_the_slot() -> None:
            parked: dict[str, Any] = {"echo_stream": {"events": 1, "hold_headers": 1}}
            holder.completions.create(model="m", prompt="x", extra_body=parked)

        nursery.start_soon(in_thread, hold_the_slot)
        with trio.fail_after(5):
            await echo.requests_parked.wait()
        client = sdk(base)

        def ask() -> openai.APIStatusError:
            with pytest.raises(openai.APIStatusError) as raised:
                client.completions.create(model="m", prompt="y")
            return raised.value

        error = await in_thread(ask)
        assert (error.status_code, error.code) == (503, "resource_busy")
        expected = "true" if expected_attempts > 1 else "false"
        assert error.response.headers["x-should-retry"] == expected
        # The holder's one admission, then the borrower's attempts.
        assert await attempts(daemon, "lender") == 1 + expected_attempts
        echo.gate.set()


async def test_answers_through_vacancyd_equal_the_servers_own(
    lender: InProcessDaemon, llama_url: str
) -> None:
    request: dict[str, Any] = {"model": MODEL, "messages": HELLO, "max_tokens": 12}
    direct, lent = (
        openai.OpenAI(base_url=f"{llama_url}/v1", api_key="x"),
        sdk(lender.proxy("lender")),
    )

    def ask(client: openai.OpenAI) -> tuple[Any, list[Any]]:
        whole = client.chat.completions.create(**request, temperature=0)
        stream = client.chat.completions.create(
            **request, temperature=0, stream=True, stream_options={"include_usage": True}
        )
        return whole, list(stream)

    (whole_direct, chunks_direct), (whole_lent, chunks_lent) = [
        await in_thread(lambda c=c: ask(c)) for c in (direct, lent)
    ]
    assert whole_lent.choices[0].message.content == whole_direct.choices[0].message.content
    # Token counts, not the whole usage: the second ask finds its prompt in the cache.
    assert tokens(whole_lent.usage) == tokens(whole_direct.usage)

    def text(chunks: list[Any]) -> str:
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    assert text(chunks_lent) == text(chunks_direct)
    assert len(chunks_lent) == len(chunks_direct)
    assert tokens(chunks_lent[-1].usage) == tokens(chunks_direct[-1].usage)


def tokens(usage: Any) -> tuple[int, int]:
    return usage.prompt_tokens, usage.completion_tokens


async def test_a_stream_cut_by_the_owner_raises_the_reason(llama_url: str, tmp_path: Path) -> None:
    """The cut stream ends with an error event: the SDK raises APIError naming the reason
    (not a bare connection error), and never sees [DONE]."""
    async with in_process_daemon(lender_config(llama_url, tmp_path / "state")) as daemon:
        client = sdk(daemon.proxy("lender"))
        token = trio.lowlevel.current_trio_token()

        def stream_until_cut() -> tuple[int, openai.APIError]:
            stream = client.completions.create(
                model=MODEL,
                prompt="Once upon a time",
                max_tokens=400,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            received = 0
            try:
                for _ in stream:
                    received += 1
                    if received == 1:
                        trio.from_thread.run_sync(owner_returns, daemon, trio_token=token)
            except openai.APIError as exc:
                return received, exc
            raise AssertionError("the stream ended without an error")

        received, error = await in_thread(stream_until_cut)
        assert received < 400
        assert not isinstance(error, openai.APIConnectionError)
        assert (error.type, error.code) == ("no_vacancy", "owner_active")
