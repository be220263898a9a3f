"""The upstream's server as processes: its memory and its settings, read with psutil.

Two facts about a model's footprint live in the server's processes, not in its API:

* host memory a load takes: the resident set (RSS) of the server and its children (an
  Ollama runner is a child of `ollama serve`), before and after an exclusive job, as
  the fall of a GPU's free memory measures a load there. RSS counts the pages of a
  mapped model file that are resident, which is what the load costs the owner;
* settings the server's API does not report: Ollama's KV cache type, flash attention,
  default context and parallel slots (its environment); llama-server's KV cache types
  (its `-ctk`/`-ctv` arguments, or `LLAMA_ARG_CACHE_TYPE_K`/`_V` in its environment).

Which processes serve an upstream is found by the caller (`FindServer`: the collectors'
socket-to-pid attribution, passed in by the service and the CLI), so this package does
not reach up into them. Everything here blocks: run it on a worker thread. A process
that vanished or belongs to another user is left out, never an error: another user's
environment is private, and such a server's settings are then stated as assumed.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from typing import Final

import attrs
import psutil

from vacancyd.config.addresses import Target

# The pids listening where an upstream's target connects (empty: none seen).
FindServer = Callable[[Target], set[int]]

MIB: Final = 1024 * 1024


@attrs.frozen
class Member:
    """A process of the server's tree, as it cannot be confused with a later one."""

    pid: int
    start_time: float


@attrs.frozen
class TreeMemory:
    """The server's processes and their resident memory, at one moment."""

    members: frozenset[Member]
    rss_bytes: int

    @property
    def rss_mib(self) -> int:
        return self.rss_bytes // MIB


def member(pid: int) -> Member | None:
    """`pid` as a Member, or None when it is gone or hidden."""
    try:
        return Member(pid, psutil.Process(pid).create_time())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def still_running(process: Member) -> bool:
    """Whether `process` still runs (its pid not handed to a later process)."""
    return member(process.pid) == process


def tree_memory(roots: Iterable[int]) -> TreeMemory | None:
    """The RSS of `roots` and all their descendants; None when no root could be read."""
    members: set[Member] = set()
    total = 0
    for pid in sorted(set(roots)):
        try:
            root = psutil.Process(pid)
            processes = [root, *root.children(recursive=True)]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        for process in processes:
            try:
                member = Member(process.pid, process.create_time())
                if member not in members:
                    total += process.memory_info().rss
                    members.add(member)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
    if not members:
        return None
    return TreeMemory(frozenset(members), total)


def members_memory(members: Iterable[Member]) -> TreeMemory | None:
    """The RSS of those of `members` (a tree read earlier) that still run, without
    looking for children they have started since; None when none still runs.

    Looking for children is what costs: psutil finds them by reading every process's
    stat file on the machine (hundreds on a desktop, milliseconds on every call); this
    reads two small files per member."""
    present: set[Member] = set()
    total = 0
    for known in members:
        try:
            process = psutil.Process(known.pid)
            if Member(known.pid, process.create_time()) != known:
                continue  # the pid now names a later process
            total += process.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        present.add(known)
    if not present:
        return None
    return TreeMemory(frozenset(present), total)


def machine_pids() -> frozenset[int] | None:
    """The pids on the machine now (one directory listing, no file read per process), or
    None where /proc cannot be listed (then only a full search finds new children)."""
    try:
        return frozenset(int(name) for name in os.listdir("/proc") if name.isdigit())
    except OSError:
        return None


def grown_tree(
    members: frozenset[Member], seen: frozenset[int], now: frozenset[int]
) -> TreeMemory | None:
    """The tree of `members` (read earlier, when the machine's pids were `seen`) with the
    processes that joined it since (among `now`, the pids listed just before this call),
    and their RSS; None when none of it still runs.

    A process that joined the tree since was started since, so its pid is one that was
    not there then: only those are read (their parent), not every process on the machine
    as psutil's search for children does. A pid reused in between is missed here; the
    caller reads the tree in full now and then for that (`tree_memory`)."""
    tree = {known.pid for known in members}
    joined: set[int] = set()
    new = sorted(now - seen - tree)
    parents: dict[int, int] = {}
    for pid in new:
        try:
            parents[pid] = psutil.Process(pid).ppid()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    # A grandchild can come before its parent in pid order: go round until nothing joins.
    while True:
        found = {pid for pid, ppid in parents.items() if ppid in tree or ppid in joined} - joined
        if not found:
            break
        joined |= found
    present = members_memory(members)
    extra = members_memory(known for pid in sorted(joined) if (known := member(pid)) is not None)
    if present is None and extra is None:
        return None
    return TreeMemory(
        (present.members if present else frozenset()) | (extra.members if extra else frozenset()),
        (present.rss_bytes if present else 0) + (extra.rss_bytes if extra else 0),
    )


def server_command(roots: Iterable[int]) -> list[str] | None:
    """The command line the server was started with (its first readable root's), or None
    where none can be read."""
    for pid in sorted(set(roots)):
        try:
            return list(psutil.Process(pid).cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied, OSError):
            continue
    return None


def server_environment(roots: Iterable[int]) -> Mapping[str, str] | None:
    """The environment the server was started with (its first readable root's), or None
    where no root's can be read (gone, or another user's)."""
    for pid in sorted(set(roots)):
        try:
            return dict(psutil.Process(pid).environ())
        except (psutil.NoSuchProcess, psutil.AccessDenied, OSError):
            continue
    return None
