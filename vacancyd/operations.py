"""How the daemon is run and looked after: liveness, systemd notifications, the log ring,
the debug window and the sources of the diagnostics document.

service.py owns start-up order and supervision; this module keeps the parts that serve
the operator rather than the borrower out of it, so the supervision reads as it runs.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator, Callable, Collection, Mapping
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import cattrs
import trio

from vacancyd.api.operator import OperatorTools
from vacancyd.collect.nvml import NvmlCollector
from vacancyd.config import Config, PresenceBackend
from vacancyd.liveness import Heartbeat, Liveness
from vacancyd.logs import DebugWindow, LogRing
from vacancyd.notify import Notifier, watchdog_interval_s
from vacancyd.presence.systemd_version import systemd_version
from vacancyd.watchdog import Health, check_health, lending_summary, run_service_notifications

_plain = cattrs.Converter()

# How long the diagnostics wait for the system bus to say which systemd runs logind.
VERSION_DEADLINE_S = 1.0


class Operations:
    """The operator's side of one daemon run (see the module docstring).

    `environ` is where systemd's variables are read ($NOTIFY_SOCKET, $WATCHDOG_USEC,
    $WATCHDOG_PID): the process environment unless a test passes its own.
    """

    def __init__(self, config: Config, environ: Mapping[str, str] | None = None) -> None:
        environ = os.environ if environ is None else environ
        self.config = config
        self.liveness = Liveness()
        self.ring = LogRing()
        self.debug = DebugWindow()
        self.notifier = Notifier.from_environ(environ)
        self.watchdog_every_s = watchdog_interval_s(environ) if self.notifier else None
        self._essential: frozenset[str] = frozenset()
        self._running: Collection[str] = ()

    @asynccontextmanager
    async def open(self) -> AsyncIterator[None]:
        """Keep the log ring attached, and the notify socket open, for the run's lifetime."""
        logger = logging.getLogger("vacancyd")
        logger.addHandler(self.ring)
        try:
            yield
        finally:
            logger.removeHandler(self.ring)
            if self.notifier is not None:
                self.notifier.close()

    def heartbeat(self, name: str, *, every_s: float, round_within_s: float) -> Heartbeat:
        """A heartbeat for the essential task `name` (vacancyd.liveness)."""
        return self.liveness.register(name, every_s=every_s, round_within_s=round_within_s)

    def health(self, now: float) -> Health:
        return check_health(self._essential, set(self._running), self.liveness, now)

    def tools(self, nvml: NvmlCollector | None) -> OperatorTools:
        """The API's view of all this (debug window, liveness, diagnostics sources)."""
        return OperatorTools(
            debug=self.debug,
            ring=self.ring,
            liveness=self.liveness,
            health=self.health,
            watchdog_every_s=self.watchdog_every_s,
            collector_details=partial(_collector_details, nvml),
            host_versions=partial(self._host_versions, nvml),
        )

    async def serve_notifications(
        self,
        running: Collection[str],
        status: Callable[[], dict[str, Any]],
        stop: trio.Event,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Tell systemd the daemon is ready, then keep it informed (vacancyd.watchdog).

        Start this once everything else is running: the tasks running at that moment are
        the essential set whose absence withholds the watchdog's pings. Without
        $NOTIFY_SOCKET there is no one to tell; a task that stops making progress is
        still logged.
        """
        self._essential = frozenset(running)
        self._running = running
        await run_service_notifications(
            self.notifier,
            ping_every_s=self.watchdog_every_s,
            refresh_every_s=self.config.server.poll_interval_s,
            health=self.health,
            summary=lambda: lending_summary(status()),
            stop=stop,
            task_status=task_status,
        )

    async def _host_versions(self, nvml: NvmlCollector | None) -> dict[str, Any]:
        driver = nvml.statistics().driver_version if nvml is not None else None
        if nvml is None:
            nvidia = "not used (no nvidia_gpu resource)"
        else:
            nvidia = driver or f"unknown: {nvml.statistics().note or 'NVML not loaded'}"
        if self.config.owner.presence is PresenceBackend.HEADLESS:
            logind = 'not used (owner.presence = "headless")'
        else:
            logind = await systemd_version(VERSION_DEADLINE_S)
        return {"nvidia_driver": nvidia, "logind": logind}


def _collector_details(nvml: NvmlCollector | None) -> dict[str, Any]:
    if nvml is None:
        return {}
    details: dict[str, Any] = _plain.unstructure(nvml.statistics())
    return {"nvml": details}
