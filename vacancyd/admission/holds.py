"""Durable holds on disk: what an earlier run could not prove stopped.

A hold exists because vacancyd could not prove a borrowed job stopped, so forgetting one
fails open. The file therefore fails closed: one that is there but cannot be trusted
(corrupt, empty, foreign, malformed, or failing persist's file checks) could have named
any resource, and every resource refuses until an admin clears it. Clearing moves the file
aside rather than deleting it: it is evidence.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from vacancyd.model import RETRY_JOB_HELD, Reason, Refuse
from vacancyd.persist import (
    StateFileProblem,
    UntrustedFile,
    move_aside,
    read_json,
    write_json,
)

log = logging.getLogger("vacancyd.admission")

HOLDS_KIND = "holds"

# Shown after the reason of a hold restored from an earlier run; never saved with it, so a
# reason does not grow by one suffix on every restart.
RESTORED_NOTE = " (restored after restart)"

UNREADABLE_HOLDS_CONSEQUENCE = (
    "every resource refuses borrowed work until an admin clears it "
    "(POST /admin/holds/unreadable/clear or `vacancyd release --unreadable-file`)"
)


class HoldsFile:
    """The holds file of one daemon, and whether it could be trusted at start."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        # Set when the file could not be trusted: every resource refuses until cleared.
        self.unreadable: StateFileProblem | None = None

    def load(self, known_resources: set[str]) -> list[dict[str, Any]]:
        """The saved holds naming only known resources; an untrusted file sets `unreadable`
        (and returns nothing)."""
        if self.path is None:
            return []
        try:
            entries = saved_holds(self.path, read_json(self.path, HOLDS_KIND))
        except UntrustedFile as exc:
            self.unreadable = StateFileProblem(
                path=str(self.path),
                kind=HOLDS_KIND,
                reason=exc.reason,
                consequence=UNREADABLE_HOLDS_CONSEQUENCE,
                resources=tuple(sorted(known_resources)),
            )
            return []
        kept = []
        for entry in entries:
            unknown = [name for name in entry["resources"] if name not in known_resources]
            if unknown:
                log.warning(
                    "ignoring saved hold %r: resources no longer configured: %s",
                    entry,
                    ", ".join(unknown),
                )
                continue
            kept.append(entry)
        return kept

    def save(self, held: list[dict[str, Any]]) -> None:
        if self.path is None:
            return
        if self.unreadable is not None:
            # Never write over the file an admin has not looked at yet: it is evidence.
            log.error(
                "not saving durable holds: %s is untrusted until an admin clears it", self.path
            )
            return
        try:
            write_json(self.path, HOLDS_KIND, {"holds": held})
        except OSError as exc:
            log.error("cannot save durable holds to %s: %s", self.path, exc)

    def clear(self, why: str) -> tuple[StateFileProblem, Path | None] | None:
        """Move the untrusted file aside; the problem it was and where the file went, or
        None if there was nothing to clear. OSError (still refusing) if it cannot move."""
        problem = self.unreadable
        if problem is None or self.path is None:
            return None
        try:
            moved: Path | None = move_aside(self.path)
        except FileNotFoundError:
            moved = None
        log.warning(
            "cleared the untrusted holds file %s (%s); %s",
            problem.path,
            why,
            f"it is kept as {moved}" if moved else "it was already gone",
        )
        self.unreadable = None
        return problem, moved


def unreadable_refusal(resource: str, problem: StateFileProblem) -> Refuse:
    """Refuse as a hold does: the file might have named this resource.

    The borrower learns only that the resource is held until an admin acts; the file's
    path and what is wrong with it are for the operator.
    """
    return Refuse(
        Reason.JOB_HELD,
        RETRY_JOB_HELD,
        f"{resource} is held: the durable holds file cannot be trusted, so any resource "
        "may still be in use; an admin must clear it",
        resource=resource,
        internal=f"{problem.path} {problem.reason}",
    )


def saved_holds(path: Path, payload: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The entries of a holds payload; UntrustedFile if any of them is malformed.

    vacancyd writes every entry itself, so one it cannot read means the file is not what
    it wrote, and a file that is not what it wrote cannot be trusted to list every hold.
    """
    if payload is None:
        return []
    entries = payload.get("holds")
    if not isinstance(entries, list):
        raise UntrustedFile(path, "has no list of holds")
    for index, entry in enumerate(entries):
        problem = _hold_problem(entry)
        if problem:
            raise UntrustedFile(path, f"has a malformed hold (entry {index}: {problem})")
    return entries


def _hold_problem(entry: Any) -> str:
    if not isinstance(entry, dict):
        return "not a table"
    resources = entry.get("resources")
    if (
        not isinstance(resources, list)
        or not resources
        or not all(isinstance(name, str) for name in resources)
    ):
        return "no resources"
    if not isinstance(entry.get("upstream"), str) or not isinstance(entry.get("reason"), str):
        return "no upstream or reason"
    job_ids = entry.get("job_ids", [])
    if not isinstance(job_ids, list) or not all(isinstance(i, str) for i in job_ids):
        return "job_ids is not a list of strings"
    if not isinstance(entry.get("model"), str | None):
        return "model is not a string"
    if not isinstance(entry.get("borrower", ""), str):
        return "borrower is not a string"
    return ""


def without_restored_notes(reason: str) -> str:
    """The reason as first given: earlier versions saved it with one note per restart."""
    while reason.endswith(RESTORED_NOTE):
        reason = reason.removesuffix(RESTORED_NOTE)
    return reason
