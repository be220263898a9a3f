"""Whether each upstream's own server can be reached without going through vacancyd.

The gate only protects what passes through it. If the inference server behind an upstream
also listens on the network, borrowers (or anyone) can skip the gate entirely; this loop
says so in /status and in the log, once per change. It reads the machine's listening
sockets, so it can only speak for targets on this machine:

* loopback_only: every socket on the target's port is bound to a loopback address;
* listens_on_network: some socket on that port is bound to a wildcard or a non-loopback
  address, so the server is reachable from elsewhere;
* unknown: no socket listens on the port, or the socket table could not be read;
* not_observable: the target is not a loopback address, so no local socket describes it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from types import MappingProxyType

import trio

from vacancyd.collect.attribution import ListenSocket, normalise_address, read_listen_sockets
from vacancyd.config import Target, is_loopback_host
from vacancyd.liveness import Heartbeat
from vacancyd.probe import CallLane, ProbeTimeout

log = logging.getLogger(__name__)

SCAN_EVERY_S = 30.0


def listener_state(target: Target, sockets: Iterable[ListenSocket]) -> str:
    if not is_loopback_host(target.host):
        return "not_observable"
    on_port = [s for s in sockets if s.port == target.port]
    if not on_port:
        return "unknown"
    for listening in on_port:
        address = normalise_address(listening.ip)
        if address is None or not address.is_loopback:
            return "listens_on_network"  # a wildcard or a routable address
    return "loopback_only"


class ListenerWatch:
    """Re-reads the socket table every SCAN_EVERY_S and publishes each upstream's state.

    The states are the watch's own; /status reads them through `states()`.
    """

    def __init__(
        self,
        targets: dict[str, Target],
        *,
        deadline_s: float,
        heartbeat: Heartbeat | None = None,
    ) -> None:
        self._targets = targets
        self._deadline_s = deadline_s
        self._heartbeat = heartbeat
        self._states: dict[str, str] = {}
        # One scan thread at most: a scan stuck in /proc is not stacked on (probe.py).
        self._lane = CallLane()

    def states(self) -> Mapping[str, str]:
        """Each upstream's latest state; a copy, so a reader never sees a scan half-done."""
        return MappingProxyType(dict(self._states))

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Scan forever; started after the first scan.

        The heartbeat beats for every read that answered, even with an error; not on a
        timeout.
        """
        started = False
        while True:
            answered = True
            try:
                sockets = await self._lane.call_unstacked(read_listen_sockets, self._deadline_s)
            except Exception as exc:  # psutil.Error, OSError or the probe's timeout
                log.debug("cannot read the listening sockets: %s", exc)
                sockets = None
                answered = not isinstance(exc, ProbeTimeout)
            if answered and self._heartbeat is not None:
                self._heartbeat.beat()
            for name, target in self._targets.items():
                found = "unknown" if sockets is None else listener_state(target, sockets)
                if found == "listens_on_network" and self._states.get(name) != found:
                    log.warning(
                        "the server behind upstream %s (%s) also listens on the network: "
                        "requests sent to it directly bypass vacancyd; bind it to loopback",
                        name,
                        target.origin,
                    )
                self._states[name] = found
            if not started:
                task_status.started()
                started = True
            await trio.sleep(SCAN_EVERY_S)


__all__ = ["ListenerWatch", "listener_state"]
