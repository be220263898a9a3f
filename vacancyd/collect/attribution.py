"""Which GPU load is the owner's: subtracting the processes that serve our own upstreams.

Borrowed work runs in the upstream's server process (or a child of it, like Ollama's
runners). If that load counted as owner load, every borrowed request would raise the
pressure it is judged by and refuse the next one: borrowed work would veto itself. So the
processes serving each upstream's target are found and their GPU use is taken out.

What is found, and what is deliberately not guessed:

* Only a loopback target (127.0.0.0/8, ::1, the name localhost) is looked up. A target on
  another host, or named any other way, is not attributable: a local process that happens
  to listen on the same port proves nothing about it.
* The process that listens on the target's port (on its address, or a wildcard address
  when nothing listens on the exact one) and all its descendants form the upstream's
  tree. When that listener only relays (a VM, a container, an SSH tunnel), the GPU work
  happens outside the tree and counts as owner load. Any other process could be the
  owner's own work run the same way, so nothing else is subtracted.
* Processes are known by (pid, start time). A pid the kernel has handed to a new process
  does not inherit the old one's exemption.

The blocking reads (psutil) are separate functions from the pure arithmetic, so the rules
can be tested with plain values and the scan with real processes.
"""

from __future__ import annotations

import ipaddress
import logging
import math
from collections.abc import Collection, Iterable, Mapping
from typing import Final

import attrs
import psutil

from vacancyd.config.addresses import Target, is_loopback_host

log = logging.getLogger(__name__)

START_TIME_TOLERANCE_S: Final = 1.5
"""Start times are compared with this slack.

psutil computes a start time as boot time plus ticks since boot, and the kernel's
boot-time figure can move by a second as the wall clock is adjusted. A pid can only be
reused after its first owner exits, so a new process starting within the slack of the old
one's start is not a practical concern.
"""

UNSEEN_AFTER_SAMPLES: Final = 3

_WILDCARDS: Final = (ipaddress.ip_address("0.0.0.0"), ipaddress.ip_address("::"))


@attrs.frozen(order=True)
class ProcessIdentity:
    """A process as it cannot be confused with a later one that reuses its pid."""

    pid: int
    start_time: float


@attrs.frozen
class ListenSocket:
    """One listening TCP socket: its address, port and owning pid (None if not visible)."""

    ip: str
    port: int
    pid: int | None


@attrs.frozen
class UpstreamTree:
    """The processes serving one upstream's target, or why there are none to subtract."""

    upstream: str
    attributable: bool
    processes: frozenset[ProcessIdentity] = frozenset()
    detail: str = ""


@attrs.frozen
class GpuAttribution:
    """One GPU's load, split between the owner and the upstream trees."""

    owner_load_pct: float
    subtracted_pct: float
    upstreams_seen: frozenset[str]


def not_attributable_reason(target: Target) -> str | None:
    """Why this target's processes cannot be found locally, or None when they can."""
    if is_loopback_host(target.host):
        return None
    return (
        f"target host {target.host} is not loopback; its GPU use cannot be told apart "
        "and counts as owner load"
    )


def listener_pids(sockets: Iterable[ListenSocket], target: Target) -> tuple[set[int], int]:
    """Pids listening where `target` connects, and how many matching sockets had no pid.

    A socket bound to the target's own address wins over a wildcard one, as it does in the
    kernel; only when nothing listens on the exact address do wildcards count. For
    `localhost` every loopback address is exact, since a client may resolve it either way.
    """
    wanted = _target_addresses(target.host)
    exact: list[ListenSocket] = []
    wildcard: list[ListenSocket] = []
    for sock in sockets:
        if sock.port != target.port:
            continue
        address = normalise_address(sock.ip)
        if address is None:
            continue
        if _matches(address, wanted):
            exact.append(sock)
        elif address in _WILDCARDS and _wildcard_serves(address, wanted):
            wildcard.append(sock)
    chosen = exact or wildcard
    pids = {s.pid for s in chosen if s.pid is not None}
    hidden = sum(1 for s in chosen if s.pid is None)
    return pids, hidden


def attribute_gpu_load(
    samples: Iterable[tuple[int, float]],
    trees: Mapping[str, UpstreamTree] | Iterable[UpstreamTree],
    start_times: Mapping[int, float],
) -> GpuAttribution:
    """Split one GPU's per-process utilisation into owner load and upstream use.

    `samples` holds one (pid, SM utilisation %) pair per process on this GPU; `start_times`
    the start time of each sampled pid as read now (a pid missing from it has exited or
    cannot be read, and is counted as the owner's). A process counts as an upstream's only
    if both its pid and its start time match a member of that upstream's tree. Owner load
    is the rest, capped at 100 %; a non-finite utilisation makes it non-finite, which the
    guard treats as an unknown reading.
    """
    members = _members(trees)
    owner = 0.0
    subtracted = 0.0
    seen: set[str] = set()
    for pid, utilisation in samples:
        share = utilisation if math.isnan(utilisation) else max(utilisation, 0.0)
        upstream = _member_of(members.get(pid, ()), start_times.get(pid))
        if upstream is None:
            owner += share
        else:
            subtracted += share
            seen.add(upstream)
    return GpuAttribution(min(owner, 100.0), subtracted, frozenset(seen))


def upstreams_of(
    pids: Iterable[int],
    trees: Mapping[str, UpstreamTree] | Iterable[UpstreamTree],
    start_times: Mapping[int, float],
) -> frozenset[str]:
    """The upstreams that these pids (with these start times) belong to.

    For the unseen-work report a process that holds a context on a GPU (NVML's compute or
    graphics list) uses that GPU even in a round where it had no utilisation sample.
    """
    members = _members(trees)
    found = set()
    for pid in pids:
        upstream = _member_of(members.get(pid, ()), start_times.get(pid))
        if upstream is not None:
            found.add(upstream)
    return frozenset(found)


def _members(
    trees: Mapping[str, UpstreamTree] | Iterable[UpstreamTree],
) -> dict[int, list[tuple[float, str]]]:
    members: dict[int, list[tuple[float, str]]] = {}
    tree_list = trees.values() if isinstance(trees, Mapping) else trees
    for tree in tree_list:
        for identity in tree.processes:
            members.setdefault(identity.pid, []).append((identity.start_time, tree.upstream))
    return members


def _member_of(candidates: Iterable[tuple[float, str]], started: float | None) -> str | None:
    if started is None:
        return None
    for start_time, upstream in candidates:
        if abs(start_time - started) <= START_TIME_TOLERANCE_S:
            return upstream
    return None


class UnseenWork:
    """Notices upstreams whose admitted work never shows up on a GPU.

    Borrowed GPU work that runs outside the upstream's process tree (behind a relay, in a
    VM or a container) is counted as owner load, which is safe but makes the upstream
    look pressured by itself. This tracker makes that visible: after `samples` attribution
    rounds in a row in which an upstream had admitted work running and no process of its
    tree used any GPU, the upstream is reported, with one warning in the log. The report
    clears as soon as a process of the tree is seen on a GPU. Nothing extra is subtracted.
    """

    def __init__(self, samples: int = UNSEEN_AFTER_SAMPLES) -> None:
        if samples < 1:
            raise ValueError("samples must be at least 1")
        self.samples = samples
        self._streak: dict[str, int] = {}
        self._unseen: set[str] = set()

    @property
    def unseen(self) -> frozenset[str]:
        return frozenset(self._unseen)

    def is_unseen(self, upstream: str) -> bool:
        return upstream in self._unseen

    def observe(self, busy: Collection[str], seen: Collection[str]) -> frozenset[str]:
        """Account one attribution round over every GPU; return the upstreams now reported.

        `busy` names the upstreams with admitted work running during the round, `seen` the
        upstreams a process of whose tree used a GPU. Call it only for rounds whose GPU
        samples were actually read: a failed read shows nothing either way.
        """
        for upstream in seen:
            self._streak.pop(upstream, None)
            if upstream in self._unseen:
                self._unseen.discard(upstream)
                log.info("upstream %s: its processes are using the GPU again", upstream)
        for upstream in list(self._streak):
            if upstream not in busy:
                del self._streak[upstream]
        for upstream in busy:
            if upstream in seen:
                continue
            streak = self._streak.get(upstream, 0) + 1
            self._streak[upstream] = streak
            if streak >= self.samples and upstream not in self._unseen:
                self._unseen.add(upstream)
                log.warning(
                    "upstream %s has had admitted work running for %d attribution samples "
                    "but none of its processes uses a GPU; its GPU work, if any, runs "
                    "outside its process tree (a relay, VM or container) and counts as "
                    "owner load (unseen_gpu_work)",
                    upstream,
                    streak,
                )
        return self.unseen


# -- the blocking reads --------------------------------------------------------------------


def read_listen_sockets() -> list[ListenSocket]:
    """Every listening TCP socket on the machine (blocking; may raise psutil.Error).

    Without privileges the pid of another user's socket is not visible; such a socket is
    returned with pid None so the caller can say why nothing was subtracted.
    """
    result = []
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status != psutil.CONN_LISTEN or not conn.laddr:
            continue
        result.append(ListenSocket(str(conn.laddr.ip), int(conn.laddr.port), conn.pid))
    return result


def server_pids(target: Target) -> set[int]:
    """The pids listening where an upstream's target connects (blocking): empty for a
    target that is not loopback, an unreadable socket table, or nothing listening. What
    the footprints read a server's memory and settings from (footprint/processes.py)."""
    if not_attributable_reason(target) is not None:
        return set()
    try:
        return listener_pids(read_listen_sockets(), target)[0]
    except (psutil.Error, OSError):
        return set()


def process_tree(pid: int) -> frozenset[ProcessIdentity]:
    """`pid` and all its descendants by identity; processes that vanish are skipped."""
    found: set[ProcessIdentity] = set()
    try:
        root = psutil.Process(pid)
        found.add(ProcessIdentity(pid, root.create_time()))
        children = root.children(recursive=True)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return frozenset(found)
    for child in children:
        try:
            found.add(ProcessIdentity(child.pid, child.create_time()))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return frozenset(found)


def scan_upstream_trees(
    targets: Mapping[str, Target], sockets: Iterable[ListenSocket] | None = None
) -> dict[str, UpstreamTree]:
    """Find every upstream's tree (blocking: run it on a worker thread with a deadline).

    `sockets` may be passed in (tests, or a caller that already read them); otherwise the
    listening sockets are read once for all upstreams, and only if some target is
    attributable. Raises psutil.Error or OSError when the socket table cannot be read;
    the caller should treat that as an unknown pressure reading.
    """
    reasons = {name: not_attributable_reason(target) for name, target in targets.items()}
    socket_list: list[ListenSocket] = []
    if any(reason is None for reason in reasons.values()):
        socket_list = list(sockets) if sockets is not None else read_listen_sockets()
    trees = {}
    for name, target in targets.items():
        reason = reasons[name]
        if reason is not None:
            trees[name] = UpstreamTree(name, attributable=False, detail=reason)
            continue
        pids, hidden = listener_pids(socket_list, target)
        processes: set[ProcessIdentity] = set()
        for pid in sorted(pids):
            processes |= process_tree(pid)
        trees[name] = UpstreamTree(
            name, True, frozenset(processes), _tree_detail(target, processes, hidden)
        )
    return trees


def current_start_times(pids: Iterable[int]) -> dict[int, float]:
    """Start times of these pids as they are now (blocking); gone or hidden ones are left out."""
    result = {}
    for pid in pids:
        try:
            result[pid] = psutil.Process(pid).create_time()
        except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
            continue
    return result


# -- helpers -------------------------------------------------------------------------------

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def _tree_detail(target: Target, processes: Collection[ProcessIdentity], hidden: int) -> str:
    where = f"{target.host}:{target.port}"
    if processes:
        return f"{len(processes)} process(es) serve {where}"
    if hidden:
        return (
            f"the listener on {where} belongs to another user and cannot be seen; "
            "nothing is subtracted"
        )
    return f"nothing listens on {where}; nothing is subtracted"


def normalise_address(text: str) -> Address | None:
    try:
        address = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _target_addresses(host: str) -> tuple[Address, ...] | None:
    """The target's exact addresses; None stands for "any loopback address" (localhost)."""
    if host == "localhost":
        return None
    address = normalise_address(host)
    return () if address is None else (address,)


def _matches(address: Address, wanted: tuple[Address, ...] | None) -> bool:
    if wanted is None:
        return address.is_loopback
    return address in wanted


def _wildcard_serves(wildcard: Address, wanted: tuple[Address, ...] | None) -> bool:
    """0.0.0.0 serves IPv4 targets; :: serves IPv6 and, dual-stack by default, IPv4 too."""
    if wildcard.version == 6:
        return True
    if wanted is None:
        return True
    return any(a.version == 4 for a in wanted)
