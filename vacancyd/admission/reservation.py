"""What an admitted borrowed job is, as every part that handles one sees it.

The ledger (ledger.py) grants and frees reservations under its rules; the proxy, the job
tracker, reclaim and the API hold them, read them and hand them back to the ledger. The
types they share live here, apart from those rules, so ledger.py is the rules alone. A
reservation's phase changes only through the ledger, by the table in phases.py.
"""

from __future__ import annotations

from typing import Protocol

import attrs

from vacancyd.accounting import ANONYMOUS
from vacancyd.admission.holds import RESTORED_NOTE
from vacancyd.admission.phases import Phase
from vacancyd.model import Refuse


class RelayHandle(Protocol):
    """How reclaim stops a proxied request: the proxy registers one per admitted job."""

    def cancel(self, refusal: Refuse) -> bool:
        """Cut the request; False when there was nothing left to cut (its whole answer
        had already been handed to the borrower)."""
        ...


@attrs.frozen
class Share:
    """A request that reuses a model its upstream proved resident: it may run beside other
    requests to the same upstream and model, up to `slots` at once."""

    model: str | None
    slots: int


@attrs.define(eq=False)
class Reservation:
    """One admitted borrowed job and the resources it holds (see phases.py)."""

    job_id: int
    upstream: str
    resources: tuple[str, ...]
    model: str | None
    started_at: float
    # Who asked: the name of the borrower's token, or "local" / "anonymous" (accounting.py).
    borrower: str = ANONYMOUS
    phase: Phase = Phase.FORWARDING
    # The upstream's own ids for this job (e.g. a ComfyUI prompt id vacancyd assigned).
    job_ids: tuple[str, ...] = ()
    hold_reason: str = ""
    held_since: str = ""
    # Restored from the holds file at start rather than made in this run.
    restored: bool = False
    # Admitted on residency credit: it loads nothing and may share its resources.
    shared: bool = False
    # What it was charged on each budgeted resource, in MiB.
    charged_mib: dict[str, int] = attrs.Factory(dict)
    # Free MiB of each GPU it holds, as last read before it was admitted (a load's
    # footprint is measured against it once the job is over).
    free_before_mib: dict[str, int] = attrs.Factory(dict)
    # The RSS of the upstream's process tree, in MiB, read just before the job was sent
    # (a load's footprint in host memory is measured against it once the job is over).
    host_rss_before_mib: int | None = None
    released_at: float | None = None
    # When the upstream had sent its whole answer (see `Ledger.answered`).
    answered_at: float | None = None

    @property
    def hold_detail(self) -> str:
        """The reason for a person: says when the hold came from an earlier run."""
        return self.hold_reason + (RESTORED_NOTE if self.restored else "")
