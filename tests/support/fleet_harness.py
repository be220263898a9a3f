"""A fleet of vacancyd lenders and the end users of a gateway in front of them.

What a gateway does with a fleet is decided by who reaches which lender, so every count
here is taken where it happens: the lenders count the borrowed requests their proxies
judged (`/status`: admitted, refused by reason), and the end users record what the
gateway answered them and which deployment LiteLLM says served (its
`x-litellm-model-api-base` response header). Nothing is inferred from timing alone.

The lenders are real daemons (`python -m vacancyd run`), each with its own ports and
state directory, all in front of one inference server; the gateway may also address that
server directly as the always-on deployment nobody borrows. The owner's moves are the
admin API's (`POST /admin/lending`, what `vacancyd pause` and `resume` send).

The end users are the openai SDK's asyncio client, run on their own asyncio loop in a
worker thread, so that the trio side (the lenders, pauses, counters) keeps running while
they wait on the gateway. Their clients never retry (`max_retries=0` unless asked): every
error the gateway answers is counted, where a default client would hide some of them by
retrying in place.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import openai
import trio
from openai.types.chat import ChatCompletionMessageParam

from tests.support.clients import lender_config
from tests.support.daemon import DaemonProcess, daemon_process

UPSTREAM = "lender"  # the upstream's name on every lender
ALWAYS_ON = "always-on"
HELLO: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say hello."}]


@attrs.frozen
class Borrowed:
    """What one lender's proxy judged since it started."""

    admitted: int
    refused: dict[str, int]

    @property
    def total(self) -> int:
        return self.admitted + sum(self.refused.values())

    def since(self, before: Borrowed) -> Borrowed:
        reasons = set(self.refused) | set(before.refused)
        refused = {r: self.refused.get(r, 0) - before.refused.get(r, 0) for r in reasons}
        return Borrowed(self.admitted - before.admitted, {r: n for r, n in refused.items() if n})


@attrs.define
class Lender:
    index: int
    daemon: DaemonProcess
    # How long its first vacancy probe took: the first one estimates the model's footprint
    # from its file, which can outlast a gateway's probe timeout.
    first_probe_s: float | None = None

    @property
    def api(self) -> str:
        return self.daemon.api

    @property
    def url(self) -> str:
        """The proxy listener borrowers (the gateway) call."""
        return self.daemon.proxies[UPSTREAM]

    @property
    def probe(self) -> str:
        return f"{self.api}/vacancy/{UPSTREAM}"

    @property
    def label(self) -> str:
        return f"lender{self.index}"


@attrs.define
class Fleet:
    lenders: list[Lender]
    target: str  # the server behind every lender, also the always-on deployment
    http: httpx.AsyncClient

    def label(self, api_base: str | None) -> str:
        """Which deployment an api base names: `lender<i>`, ALWAYS_ON, or the base itself."""
        if api_base is None:
            return "-"
        root = api_base.rstrip("/").removesuffix("/v1")
        for lender in self.lenders:
            if root == lender.url:
                return lender.label
        return ALWAYS_ON if root == self.target else root

    async def set_lending(self, index: int, enabled: bool) -> float:
        """Pause or resume one lender; the time.monotonic() at which it was asked (so a
        delay measured from it includes the switch itself)."""
        asked = time.monotonic()
        answer = await self.http.post(
            f"{self.lenders[index].api}/admin/lending", json={"enabled": enabled}
        )
        answer.raise_for_status()
        assert answer.json()["lending"]["enabled"] is enabled, answer.text
        return asked

    async def pause(self, index: int) -> float:
        return await self.set_lending(index, False)

    async def resume(self, index: int) -> float:
        return await self.set_lending(index, True)

    async def status(self, index: int) -> dict[str, Any]:
        document: dict[str, Any] = (await self.http.get(f"{self.lenders[index].api}/status")).json()
        return document

    async def until_vacant(self, index: int, *, timeout_s: float = 60.0) -> float:
        """Ask the lender's probe until it says yes, as a gateway's first probe would; how
        long the first answer took. A lender that does not lend after start is a broken
        fixture, not a finding."""
        started = time.monotonic()
        first: float | None = None
        with trio.fail_after(timeout_s):
            while True:
                answer = await self.http.get(self.lenders[index].probe)
                first = time.monotonic() - started if first is None else first
                if answer.status_code == 200 and answer.json().get("vacancy") is True:
                    return first
                await trio.sleep(0.2)

    async def borrowed_count(self, index: int) -> Borrowed:
        entry = (await self.status(index))["upstreams"][UPSTREAM]
        return Borrowed(int(entry["admitted"]), {k: int(v) for k, v in entry["refused"].items()})

    async def back_after(
        self, index: int, before: Borrowed, since: float, *, timeout_s: float, poll_s: float = 0.1
    ) -> float | None:
        """Seconds from `since` (time.monotonic()) to the first request the lender admitted
        after `before` was read, placed by its own decision's age; None if none came
        within `timeout_s`."""
        deadline = since + timeout_s
        while time.monotonic() < deadline:
            read_at = time.monotonic()
            entry = (await self.status(index))["upstreams"][UPSTREAM]
            if int(entry["admitted"]) > before.admitted:
                decided = read_at - float(entry["last_decision"]["age_s"])
                # The first admission may be older than the newest one: with a poll every
                # `poll_s` at most that much older, so the figure errs on the late side.
                return max(0.0, decided - since)
            await trio.sleep(poll_s)
        return None


@asynccontextmanager
async def start_fleet(
    directory: Path,
    target: str,
    count: int,
    *,
    upstream_extra: str | Sequence[str] = "",
) -> AsyncIterator[Fleet]:
    """`count` lenders (real daemons) in front of `target`; `upstream_extra` goes into each
    one's [[upstream]] table (one string for all, or one per lender)."""
    extras = [upstream_extra] * count if isinstance(upstream_extra, str) else list(upstream_extra)
    assert len(extras) == count
    async with AsyncExitStack() as stack:
        http = await stack.enter_async_context(httpx.AsyncClient(trust_env=False, timeout=30))
        lenders = []
        for index, extra in enumerate(extras):
            state = directory / f"lender{index}"
            state.mkdir(parents=True, exist_ok=True)
            config = state / "vacancyd.toml"
            config.write_text(
                lender_config(target, state / "state", name=UPSTREAM, upstream_extra=extra)
            )
            daemon = await stack.enter_async_context(daemon_process(config))
            lenders.append(Lender(index, daemon))
        fleet = Fleet(lenders, target, http)
        for lender in lenders:
            lender.first_probe_s = await fleet.until_vacant(lender.index)
        yield fleet


# -- end users ---------------------------------------------------------------------------


@attrs.frozen
class Outcome:
    sent_at: float  # time.monotonic()
    answered_at: float
    group: str  # the model the end user asked the gateway for
    served_by: str | None  # the api base LiteLLM reports, on success
    status: int  # 200, the gateway's error status, or 0 without an answer
    error: str | None

    @property
    def ok(self) -> bool:
        return self.error is None


class EndUsers:
    """`users` end users asking the gateway one after the other, until told to stop."""

    def __init__(
        self,
        gateway: str,
        api_key: str,
        *,
        users: int,
        group: str,
        max_tokens: int = 4,
        timeout_s: float = 120.0,
        max_retries: int = 0,
    ) -> None:
        self.gateway = gateway
        self.api_key = api_key
        self.users = users
        self.group = group  # what the next requests ask for; the trio side may change it
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.outcomes: list[Outcome] = []  # appended by the worker thread only
        self.stopping = threading.Event()

    def run(self) -> None:
        """The worker thread's body."""
        asyncio.run(self._main())

    async def _main(self) -> None:
        client = openai.AsyncOpenAI(
            base_url=f"{self.gateway}/v1",
            api_key=self.api_key,
            max_retries=self.max_retries,
            timeout=self.timeout_s,
            http_client=openai.DefaultAsyncHttpxClient(trust_env=False),
        )
        async with client:
            await asyncio.gather(*(self._user(client) for _ in range(self.users)))

    async def _user(self, client: openai.AsyncOpenAI) -> None:
        while not self.stopping.is_set():
            self.outcomes.append(await ask(client, self.group, self.max_tokens))

    async def count_at_least(self, n: int, *, timeout_s: float) -> list[Outcome]:
        """Wait (on the trio side) until `n` outcomes are in; all of them so far."""
        with trio.fail_after(timeout_s):
            while len(self.outcomes) < n:  # noqa: ASYNC110 (another thread appends)
                await trio.sleep(0.05)
        return list(self.outcomes)

    async def more(self, n: int, *, timeout_s: float) -> list[Outcome]:
        """The next `n` outcomes (from now on)."""
        start = len(self.outcomes)
        return (await self.count_at_least(start + n, timeout_s=timeout_s))[start : start + n]


async def ask(client: openai.AsyncOpenAI, group: str, max_tokens: int) -> Outcome:
    """One chat completion through the gateway, with which deployment served it."""
    sent = time.monotonic()
    try:
        raw = await client.chat.completions.with_raw_response.create(
            model=group, messages=HELLO, max_tokens=max_tokens
        )
        raw.parse()
    except openai.APIStatusError as exc:
        kind = exc.type if isinstance(exc.type, str) else ""
        return Outcome(sent, time.monotonic(), group, None, exc.status_code, f"{kind} {exc}")
    except openai.APIError as exc:
        return Outcome(sent, time.monotonic(), group, None, 0, f"{type(exc).__name__}: {exc}")
    base = raw.headers.get("x-litellm-model-api-base")
    return Outcome(sent, time.monotonic(), group, base, raw.http_response.status_code, None)


@asynccontextmanager
async def end_users(
    gateway: str, api_key: str, *, users: int, group: str, **options: Any
) -> AsyncIterator[EndUsers]:
    """End users sending requests through `gateway` for as long as the block runs; the
    requests in flight when it ends are finished and counted."""
    crowd = EndUsers(gateway, api_key, users=users, group=group, **options)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.to_thread.run_sync, crowd.run)
        try:
            yield crowd
        finally:
            crowd.stopping.set()


def served(fleet: Fleet, outcomes: Iterable[Outcome]) -> Counter[str]:
    """Successful requests per deployment label."""
    return Counter(fleet.label(o.served_by) for o in outcomes if o.ok)


def failures(outcomes: Iterable[Outcome]) -> list[Outcome]:
    return [o for o in outcomes if not o.ok]


async def one_request(gateway: str, api_key: str, group: str) -> Outcome:
    """A single end user's request, from the trio side."""

    async def once() -> Outcome:
        client = openai.AsyncOpenAI(
            base_url=f"{gateway}/v1",
            api_key=api_key,
            max_retries=0,
            http_client=openai.DefaultAsyncHttpxClient(trust_env=False),
        )
        async with client:
            return await ask(client, group, 4)

    return await trio.to_thread.run_sync(lambda: asyncio.run(once()))
