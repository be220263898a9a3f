"""Waiting on the daemon's /status: one poller for every test that reads it until it shows
something.

A daemon in this process changes its shared state whenever a collector or a proxy does
something, so it is read again after each change (`wake=daemon.state.wait_changed`); a
daemon in a process of its own is read again every `poll_s`. Either way the wait is
bounded in time, and a wait that ends without the condition fails naming it, with the last
document read and, where given, the daemon's log.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import trio

# How often /status is read again when nothing wakes the poller sooner.
POLL_S = 0.05


async def status_until(
    fetch: Callable[[], Awaitable[dict[str, Any]]],
    predicate: Callable[[dict[str, Any]], bool],
    what: str,
    *,
    timeout_s: float,
    wake: Callable[[], Awaitable[None]] | None = None,
    poll_s: float = POLL_S,
    log: Callable[[], str] | None = None,
) -> dict[str, Any]:
    """The first document `fetch` returns of which `predicate` holds.

    Between reads, awaits `wake()` where given (an in-process daemon's change event, say),
    otherwise sleeps `poll_s` and reads at most `timeout_s / poll_s + 1` times. Fails with
    an AssertionError after `timeout_s`.
    """
    document: dict[str, Any] = {}
    polls = None if wake is not None else int(timeout_s / poll_s) + 1
    with trio.move_on_after(timeout_s):
        read = 0
        while polls is None or read < polls:
            document = await fetch()
            read += 1
            if predicate(document):
                return document
            if wake is not None:
                await wake()
            else:
                await trio.sleep(poll_s)
    message = (
        f"/status never showed {what} within {timeout_s:g}s; last document:\n"
        f"{json.dumps(document, indent=2)}"
    )
    if log is not None:
        message += f"\ndaemon log:\n{log()}"
    raise AssertionError(message)
