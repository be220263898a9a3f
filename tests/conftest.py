from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from tests.support.llama import llama_server
from tests.support.plain_upstream import PlainUpstream, serve_plain
from tests.support.upstreams import EchoUpstream, serve_echo


@pytest.fixture(scope="session")
def llama_url() -> Iterator[str]:
    """One real llama-server for the whole session (two slots, so the proxy serialises)."""
    with llama_server() as url:
        yield url


@pytest.fixture
async def echo() -> AsyncIterator[EchoUpstream]:
    async with serve_echo() as upstream:
        yield upstream


@pytest.fixture
def plain() -> Iterator[PlainUpstream]:
    """A stdlib keep-alive HTTP/1.1 upstream that never upgrades and records every request."""
    with serve_plain() as upstream:
        yield upstream
