"""Serving an ASGI app on one listener with hypercorn's trio worker.

Shared by the proxies and the API so both get the same timeouts and logging. Each call
is one listener with its own hypercorn Config, which is what makes limits per listener.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve

from vacancyd.config import HostPort, LimitsConfig

log = logging.getLogger("vacancyd.http")


def hypercorn_config(
    listen: HostPort, limits: LimitsConfig, *, grace_s: float, date_header: bool
) -> HypercornConfig:
    config = HypercornConfig()
    config.bind = [str(listen)]
    # Hypercorn's keep-alive timer runs from accept until a request's headers are complete,
    # and again after each response: it is both the header deadline and the idle reaper.
    config.keep_alive_timeout = limits.header_timeout_s
    config.graceful_timeout = grace_s
    config.accesslog = None
    config.errorlog = log
    config.include_server_header = False
    # A proxy passes the upstream's Date through; adding ours would send two.
    config.include_date_header = date_header
    return config


async def serve_app(
    app: Callable[..., Awaitable[None]] | Any,
    listen: HostPort,
    limits: LimitsConfig,
    *,
    grace_s: float,
    shutdown_trigger: Callable[[], Awaitable[None]],
    date_header: bool = False,
    on_bound: Callable[[list[str]], None] | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until `shutdown_trigger` returns; started once the socket is bound."""
    config = hypercorn_config(listen, limits, grace_s=grace_s, date_header=date_header)

    async def _serve(*, task_status: trio.TaskStatus[list[str]]) -> None:
        await serve(app, config, shutdown_trigger=shutdown_trigger, task_status=task_status)

    async with trio.open_nursery() as nursery:
        binds: list[str] = await nursery.start(_serve)
        if on_bound is not None:
            on_bound(binds)
        task_status.started(binds)
