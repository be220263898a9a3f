"""Admission: the gate's answer, the ledger's reservations, durable holds, residency credit.

* gatekeeper.py: `Admission`, the one step from a request to a reservation or a refusal.
* need.py: the footprint a request is charged (configured, found, the default's floor).
* ledger.py: who uses each resource; one load at a time, parallel resident requests.
* reservation.py: what an admitted job is (`Reservation`, `Share`, `RelayHandle`).
* phases.py: a reservation's lifecycle as a transition table.
* holds.py: durable holds on disk, failing closed.
"""

from vacancyd.admission.gatekeeper import (
    POST_RELEASE_WAIT_S,
    PROOF_MAX_AGE_S,
    Admission,
    Prove,
    Vacancy,
)
from vacancyd.admission.holds import HOLDS_KIND
from vacancyd.admission.ledger import Ledger, LedgerStatistics
from vacancyd.admission.need import need_for
from vacancyd.admission.phases import Event, IllegalMove, Phase
from vacancyd.admission.reservation import RelayHandle, Reservation, Share

__all__ = [
    "HOLDS_KIND",
    "POST_RELEASE_WAIT_S",
    "PROOF_MAX_AGE_S",
    "Admission",
    "Event",
    "IllegalMove",
    "Ledger",
    "LedgerStatistics",
    "Phase",
    "Prove",
    "RelayHandle",
    "Reservation",
    "Share",
    "Vacancy",
    "need_for",
]
