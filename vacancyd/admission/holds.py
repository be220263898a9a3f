"""Durable holds on disk: what an earlier run could not prove stopped.

A hold exists because vacancyd could not prove a borrowed job stopped, so forgetting one
fails open. The file therefore fails closed: one that is there but cannot be trusted
(corrupt, empty, foreign, malformed, or failing persist's file checks) could have named
any resource, and every resource refuses until an admin clears it. Clearing moves the file
aside rather than deleting it: it is evidence.

Writing fails closed too. A hold that cannot be saved (a full or read-only file system, a
directory where the file should be) still holds in memory, is reported in /status
`state_files` and at ERROR, and the ledger saves again every few seconds until the write
succeeds. Meanwhile a copy goes to the runtime directory (systemd's RuntimeDirectory, a
tmpfs apart from the state directory) where there is one, so a restart before the disk
recovers still finds the hold. And at start the file is written back: a run that cannot
write it cannot tell whether the run before it left a hold unsaved, so every resource
refuses until an admin clears that, which needs the file to be writable again.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import attrs

from vacancyd.accounting import UNKNOWN
from vacancyd.config.strict import StrictProblems, structure
from vacancyd.model import RETRY_JOB_HELD, Reason, Refuse
from vacancyd.persist import (
    StateFileProblem,
    StateFileProblems,
    UntrustedFile,
    move_aside,
    read_json,
    write_json,
)

log = logging.getLogger("vacancyd.admission")


def _strings(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


def _some_resources(_: Any, field: attrs.Attribute[Any], value: tuple[str, ...]) -> None:
    if not value:
        raise ValueError("the hold names no resources")


@attrs.frozen(kw_only=True)
class SavedHold:
    """One durable hold as the file keeps it (the fields in the order they are written)."""

    # The run's own number for the job; a restored hold gets a new one.
    job_id: int | None = None
    upstream: str
    borrower: str = UNKNOWN
    resources: tuple[str, ...] = attrs.field(converter=_strings, validator=_some_resources)
    model: str | None = None
    job_ids: tuple[str, ...] = attrs.field(default=(), converter=_strings)
    reason: str
    since: str = ""


@attrs.frozen
class SavedHolds:
    holds: tuple[SavedHold, ...] = attrs.field(converter=tuple)


HOLDS_KIND = "holds"

# Shown after the reason of a hold restored from an earlier run; never saved with it, so a
# reason does not grow by one suffix on every restart.
RESTORED_NOTE = " (restored after restart)"

UNREADABLE_HOLDS_CONSEQUENCE = (
    "every resource refuses borrowed work until an admin clears it "
    "(POST /admin/holds/unreadable/clear or `vacancyd release --unreadable-file`)"
)
UNSAVED_HOLDS_CONSEQUENCE = (
    "the durable holds in effect now still refuse their resources, but they are not on "
    "disk: a restart would go back to the holds last saved; vacancyd tries to save them "
    "again every few seconds"
)
UNVERIFIED_HOLDS_REASON = (
    "cannot be written at start ({why}), so a hold the last run could not save may be missing"
)
# The copy kept in the runtime directory while the holds file cannot be written.
COPY_NAME = "holds.unsaved.json"


class HoldsFile:
    """The holds file of one daemon, whether it could be trusted at start, and whether the
    holds in effect now are saved (see the module docstring)."""

    def __init__(
        self,
        path: Path | None,
        problems: StateFileProblems | None = None,
        copy_dir: Path | None = None,
    ) -> None:
        self.path = path
        self._problems = StateFileProblems() if problems is None else problems
        # Where the holds go while the file cannot be written, if anywhere.
        self.copy_path = copy_dir / COPY_NAME if copy_dir is not None and path else None
        # Set when the file could not be trusted: every resource refuses until cleared.
        self.unreadable: StateFileProblem | None = None
        # Why the last save failed; None once the holds in effect are saved.
        self.not_saved: str | None = None
        # The unreadable problem is that the file could not be written at start (nothing to
        # move aside when it is cleared, only a write to make).
        self._unverified = False

    def load(self, known_resources: set[str]) -> list[SavedHold]:
        """The saved holds naming only known resources, with those of a copy an earlier run
        left in the runtime directory. An untrusted file sets `unreadable`; the holds of
        the other file, if it can be trusted, are still returned, so that clearing the
        untrusted one keeps them."""
        if self.path is None:
            return []
        entries: list[SavedHold] = []
        for path in (self.path, self.copy_path):
            if path is None:
                continue
            try:
                entries += saved_holds(path, read_json(path, HOLDS_KIND))
            except UntrustedFile as exc:
                self.unreadable = self.unreadable or StateFileProblem(
                    path=str(path),
                    kind=HOLDS_KIND,
                    reason=exc.reason,
                    consequence=UNREADABLE_HOLDS_CONSEQUENCE,
                    resources=tuple(sorted(known_resources)),
                )
        kept: list[SavedHold] = []
        for entry in entries:
            unknown = [name for name in entry.resources if name not in known_resources]
            if unknown:
                log.warning(
                    "ignoring saved hold %r: resources no longer configured: %s",
                    entry,
                    ", ".join(unknown),
                )
                continue
            if entry not in kept:  # the copy repeats what the file already had
                kept.append(entry)
        return kept

    def save(self, held: list[SavedHold]) -> str | None:
        """Write the holds now; None when they are saved, else why not (also reported)."""
        if self.path is None:
            return None
        if self.unreadable is not None:
            # Never write over the file an admin has not looked at yet: it is evidence.
            log.error(
                "not saving durable holds: %s is untrusted until an admin clears it", self.path
            )
            return f"{self.path} is untrusted until an admin clears it"
        try:
            write_json(self.path, HOLDS_KIND, unstructured(held))
        except OSError as exc:
            return self._unsaved(held, f"cannot be written: {exc.strerror or exc}")
        if self.not_saved is not None:
            log.info("durable holds saved to %s again", self.path)
        self.not_saved = None
        self._problems.resolve(self.path)
        self._drop_copy()
        return None

    def _unsaved(self, held: list[SavedHold], why: str) -> str:
        assert self.path is not None
        copied = self._save_copy(held)
        log.error("cannot save durable holds to %s: %s; %s", self.path, why, copied)
        self.not_saved = why
        self._problems.report(
            StateFileProblem(
                path=str(self.path),
                kind=HOLDS_KIND,
                reason=why,
                consequence=f"{UNSAVED_HOLDS_CONSEQUENCE}; {copied}",
                resources=tuple(sorted({name for entry in held for name in entry.resources})),
            )
        )
        return f"{self.path} {why}"

    def _save_copy(self, held: list[SavedHold]) -> str:
        """Keep the holds in the runtime directory; says where, or why not, for the log."""
        if self.copy_path is None:
            return "no runtime directory to keep a copy in"
        try:
            write_json(self.copy_path, HOLDS_KIND, unstructured(held))
        except OSError as exc:
            return f"the copy in {self.copy_path} cannot be written either ({exc.strerror})"
        return f"a copy is kept in {self.copy_path} for a restart"

    def _drop_copy(self) -> None:
        if self.copy_path is None:
            return
        try:
            self.copy_path.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("cannot remove %s: %s", self.copy_path, exc.strerror or exc)

    def distrust_start(self, why: str, known_resources: set[str]) -> StateFileProblem:
        """The file could not be written at start: fail closed as for an untrusted file."""
        assert self.path is not None
        self._unverified = True
        self.unreadable = StateFileProblem(
            path=str(self.path),
            kind=HOLDS_KIND,
            reason=UNVERIFIED_HOLDS_REASON.format(why=why),
            consequence=UNREADABLE_HOLDS_CONSEQUENCE,
            resources=tuple(sorted(known_resources)),
        )
        return self.unreadable

    def clear(self, why: str, held: list[SavedHold]) -> tuple[StateFileProblem, Path | None] | None:
        """Move the untrusted file aside; the problem it was and where the file went, or
        None if there was nothing to clear. OSError (still refusing) if it cannot move.

        A file that could not be written at start is not moved (there is nothing wrong in
        it): it must take the holds in effect (`held`) now, or OSError, still refusing."""
        problem = self.unreadable
        if problem is None or self.path is None:
            return None
        moved: Path | None = None
        if self._unverified:
            write_json(self.path, HOLDS_KIND, unstructured(held))
        else:
            try:
                moved = move_aside(Path(problem.path))
            except FileNotFoundError:
                moved = None
        log.warning(
            "cleared the untrusted holds file %s (%s); %s",
            problem.path,
            why,
            f"it is kept as {moved}" if moved else "nothing was moved aside",
        )
        self.unreadable = None
        self._unverified = False
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


def saved_holds(path: Path, payload: dict[str, Any] | None) -> list[SavedHold]:
    """The entries of a holds payload; UntrustedFile if any of them is malformed.

    vacancyd writes every entry itself, so one it cannot read means the file is not what
    it wrote, and a file that is not what it wrote cannot be trusted to list every hold.
    The payload is read through the same strict converter as the config: a key vacancyd
    does not write, a value of the wrong type, or a hold with no resources is malformed.
    """
    if payload is None:
        return []
    try:
        return list(structure(payload, SavedHolds).holds)
    except StrictProblems as exc:
        raise UntrustedFile(path, f"has malformed holds ({exc.problems[0]})") from exc


def unstructured(held: list[SavedHold]) -> dict[str, Any]:
    """The payload that `saved_holds` reads back."""
    return {"holds": [attrs.asdict(entry) for entry in held]}


def without_restored_notes(reason: str) -> str:
    """The reason as first given: earlier versions saved it with one note per restart."""
    while reason.endswith(RESTORED_NOTE):
        reason = reason.removesuffix(RESTORED_NOTE)
    return reason
