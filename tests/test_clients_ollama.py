"""The real ollama client against vacancyd in front of the fake Ollama.

The ollama client keeps a server's `{"error": ...}` as it finds it and exposes no response
headers, so the reason must be in that string: on Ollama's native routes vacancyd answers
as Ollama does, `{"error": "<code>: <message> (retry after N s)"}`. A stream cut by the
owner's return ends with an NDJSON error line, as Ollama ends its own failed streams, so
the client raises `ResponseError` rather than a bare transport error.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import ollama
import pytest
import trio

from tests.support.clients import attempts, in_thread, lender_config, owner_returns
from tests.support.daemon import InProcessDaemon, in_process_daemon
from tests.support.fake_http import serve_fake
from tests.support.fake_ollama import FakeOllama

MODEL = "llama3.2:latest"


def refusal(call: Callable[[], object]) -> ollama.ResponseError:
    with pytest.raises(ollama.ResponseError) as raised:
        call()
    return raised.value


@pytest.fixture
async def lent(tmp_path: Path) -> AsyncIterator[tuple[FakeOllama, InProcessDaemon]]:
    async with (
        serve_fake(FakeOllama()) as server,
        in_process_daemon(lender_config(server.url, tmp_path / "state", adapter="ollama")) as d,
    ):
        yield server, d


async def test_a_refusal_is_a_response_error_whose_string_names_the_reason(
    lent: tuple[FakeOllama, InProcessDaemon],
) -> None:
    server, daemon = lent
    daemon.state.set_lending(False)
    client = ollama.Client(host=daemon.proxy("lender"))

    calls = [
        lambda: client.generate(model=MODEL, prompt="hi"),
        lambda: client.chat(model=MODEL, messages=[{"role": "user", "content": "hi"}]),
        client.ps,
    ]

    def ask() -> list[ollama.ResponseError]:
        with client:
            return [refusal(call) for call in calls]

    generate, chat, ps = await in_thread(ask)
    for refused in (generate, chat):
        assert refused.status_code == 503
        assert isinstance(refused.error, str)
        assert refused.error.startswith("lending_disabled: ")
        assert "retry after 300s" in refused.error
    assert ps.status_code == 403 and ps.error.startswith("management_denied: ")
    assert await attempts(daemon, "lender") == 2  # the client never retries
    assert server.seen == []


@pytest.mark.slow
async def test_a_stream_cut_by_the_owner_is_a_response_error(
    lent: tuple[FakeOllama, InProcessDaemon],
) -> None:
    server, daemon = lent
    server.hold_streams()
    client = ollama.Client(host=daemon.proxy("lender"))
    token = trio.lowlevel.current_trio_token()

    def stream_until_cut() -> tuple[list[Any], ollama.ResponseError]:
        received: list[Any] = []
        with client, pytest.raises(ollama.ResponseError) as raised:
            for part in client.generate(model=MODEL, prompt="hi", stream=True):
                received.append(part)
                trio.from_thread.run_sync(owner_returns, daemon, trio_token=token)
        return received, raised.value

    received, error = await in_thread(stream_until_cut)
    assert [part.response for part in received] == ["Hello"]
    assert isinstance(error.error, str) and error.error.startswith("owner_active: ")
