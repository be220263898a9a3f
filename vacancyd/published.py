"""What the daemon's parts publish for /status, /readyz and /metrics.

The shared state holds readings that decisions rest on; facts that are only reported
(which addresses a listener bound, what the NVML collector has to say, which upstreams
run work no GPU process accounts for, whether a server also listens on the network, which
state files were not trusted) belong to the part that knows them. Each part keeps its own
and the API reads them through this bundle, so no part writes into another's status and
the API cannot depend on a collector or the proxy (the layers contract forbids it): the
service, which builds both, hands the readers over.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import attrs

from vacancyd.persist import StateFileProblems
from vacancyd.reachability import Reachability


@attrs.frozen
class ListenersView:
    """Every listener's bound addresses, and whether all of them are bound yet."""

    bound: Mapping[str, tuple[str, ...]] = attrs.Factory(dict)
    complete: bool = False

    def addresses(self, name: str) -> list[str]:
        return list(self.bound.get(name, ()))


class BoundListeners:
    """The service's record of what it bound, in the order it bound it.

    Readiness waits for `complete`: a daemon that answers /readyz while one upstream's
    port is still unbound would let a gateway send traffic that cannot arrive.
    """

    def __init__(self) -> None:
        self._bound: dict[str, tuple[str, ...]] = {}
        self._complete = False

    def record(self, name: str, addresses: list[str]) -> list[str]:
        self._bound[name] = tuple(addresses)
        return addresses

    def mark_complete(self) -> None:
        self._complete = True

    def view(self) -> ListenersView:
        return ListenersView(dict(self._bound), self._complete)


@attrs.frozen
class PresenceSource:
    """Which presence backend the daemon chose, and what it can and cannot see."""

    name: str = "none"
    scope_note: str = ""


def _no_notes() -> Mapping[str, str]:
    return {}


def _no_upstreams() -> frozenset[str]:
    return frozenset()


# /status `sleep` where nothing watches logind for suspends (not Linux).
NOT_WATCHED: Mapping[str, object] = {
    "watched": False,
    "delay_lock_held": False,
    "going_to_sleep": False,
    "delay_max_s": None,
    "last_release_s": None,
    "detail": "not watched on this platform",
}


def _not_watched() -> Mapping[str, object]:
    return NOT_WATCHED


@attrs.frozen
class Published:
    """The readers the API is given; each callable returns its owner's current view."""

    listeners: BoundListeners = attrs.Factory(BoundListeners)
    reachability: Reachability = attrs.Factory(Reachability)
    state_files: StateFileProblems = attrs.Factory(StateFileProblems)
    presence: PresenceSource = PresenceSource()
    # One line per collector, e.g. "nvml": "NVML not loadable: ...".
    collector_notes: Callable[[], Mapping[str, str]] = _no_notes
    # Upstreams with admitted work running but no process of theirs seen on a GPU.
    unseen_gpu_work: Callable[[], frozenset[str]] = _no_upstreams
    # Per upstream: does its own server listen only on loopback? (collect/listeners.py)
    listener_states: Callable[[], Mapping[str, str]] = _no_notes
    # Whether suspends are watched and a delay lock is held (presence/sleep.py).
    sleep: Callable[[], Mapping[str, object]] = _not_watched
    # The session agents' socket and what it heard, at a trio time (presence/agents.py);
    # None where no agent can report (not logind, or no socket).
    agents: Callable[[float], Mapping[str, object]] | None = None
