"""Owner programs: configured process names that mean "the owner is using this machine".

A game or a render the owner left running keeps the GPU theirs even when the desktop
reports them idle, so a match engages the owner veto (state.owner_match) whatever the
session state says. Only the processes of the user at the unlocked desktop are looked at:
a program of another account, a service, or one left behind a locked screen is not the
owner sitting at the machine, and a program run by a borrower must not veto lending.

Matching is exact and case-sensitive, on the process name and on the basename of its
executable, so "steam" matches neither "steamwebhelper" nor "Steam". The scan walks /proc
through psutil, which blocks and can stall on a wedged process, so it runs on a worker
thread under a deadline; a scan that overruns is abandoned and its thread left to finish.
The caller's call lane (probe.py) keeps it to one such thread: until it comes back, the
next scan is refused at once rather than started behind it.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from functools import partial

import psutil

from vacancyd.probe import CallLane, ProbeStuck, ProbeTimeout


class OwnerScanTimeout(Exception):
    """The process scan did not finish within its deadline."""


def find_owner_programs(names: Collection[str], uids: Collection[int]) -> tuple[str, ...]:
    """The configured `names` running as one of `uids` (real uid), sorted; blocks.

    A process whose executable cannot be read (another user's, without privilege) is still
    matched on its name.
    """
    wanted = frozenset(names)
    owners = frozenset(uids)
    if not wanted or not owners:
        return ()
    found: set[str] = set()
    for process in psutil.process_iter(["name", "exe", "uids"]):
        info = process.info
        ids = info.get("uids")
        if ids is None or ids.real not in owners:
            continue
        name = info.get("name")
        if name in wanted:
            found.add(name)
        exe = info.get("exe")
        if exe:
            base = os.path.basename(exe)
            if base in wanted:
                found.add(base)
    return tuple(sorted(found))


async def scan_owner_programs(
    names: Collection[str], uids: Collection[int], *, deadline_s: float, lane: CallLane
) -> tuple[str, ...]:
    """find_owner_programs on a worker thread of `lane`; raises OwnerScanTimeout past
    `deadline_s`, or at once while an earlier scan on `lane` is still stuck."""
    try:
        return await lane.call_unstacked(partial(find_owner_programs, names, uids), deadline_s)
    except ProbeStuck as exc:
        raise OwnerScanTimeout(f"owner-process scan: {exc}") from None
    except ProbeTimeout:
        raise OwnerScanTimeout(
            f"owner-process scan did not finish within {deadline_s:g}s"
        ) from None
