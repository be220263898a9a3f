"""Residency proof: whether a request would reuse a model the upstream holds as loaded.

Each adapter that can tell says how (`ResidencyProver`): what to read from the server and
how to judge one request against that reading. `ResidencyWatch` keeps the last reading of
one upstream and reads again when the reading is older than admission accepts or older
than the last job end or yield it is told about, so back-to-back requests cost one read
every few seconds rather than one each. A reading that fails is a proof of nothing.

One read at a time: requests and vacancy probes that find the reading stale while a read
is out wait for that read instead of sending their own. Eight probes at once used to send
eight reads; llama-server gives each kept-alive connection one of its few HTTP threads,
so the later reads waited out the deadline, and the slowest (failed) one overwrote the
good reading its siblings had taken, so the probe said "not resident" for seconds.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Protocol

import attrs
import trio

from vacancyd.adapters.actions import UpstreamCallError, UpstreamContext
from vacancyd.admission import PROOF_MAX_AGE_S
from vacancyd.errors import log_unexpected
from vacancyd.model import Residency

log = logging.getLogger(__name__)

# The longest a residency read may take; past it the request is judged without credit.
READ_DEADLINE_S = 2.0


@attrs.frozen
class WorkRequest:
    """What a prover needs of one work request."""

    model: str | None
    path: str
    body: Mapping[str, Any] = attrs.Factory(dict)


class ResidencyProver(Protocol):
    """An adapter's way to prove residency: read the server, then judge requests."""

    source: str  # what is read, for details ("/slots", "/api/ps")

    async def read(self, context: UpstreamContext) -> Any:
        """The server's state as one value; UpstreamCallError when it cannot be read."""
        ...

    def judge(self, reading: Any, request: WorkRequest, taken_at: float) -> Residency: ...

    async def learn(self, context: UpstreamContext, request: WorkRequest) -> None:
        """Called after a request that was not credited has been served: a prover that
        learns how requests load models (Ollama's contexts) reads the server now."""
        ...


class ResidencyWatch:
    """The residency of one upstream, read at most every PROOF_MAX_AGE_S seconds."""

    def __init__(self, prover: ResidencyProver, context: UpstreamContext) -> None:
        self._prover = prover
        self._context = context
        self._reading: Any = None
        self._taken_at = float("-inf")
        self._error = ""
        # Set when the read in flight ends (None: no read is out).
        self._in_flight: trio.Event | None = None

    async def prove(self, request: WorkRequest, not_before: float) -> Residency:
        """Judge `request` on a reading taken no earlier than `not_before` and at most
        PROOF_MAX_AGE_S ago, reading the server again if the last one does not qualify
        (or waiting for the read already out)."""
        while not self._qualifies(not_before):
            in_flight = self._in_flight
            if in_flight is None:
                await self._read()
                break
            # A read that started before `not_before` (or was abandoned) leaves the
            # reading unqualified: the loop then sends one of its own.
            await in_flight.wait()
        if self._error:
            return Residency(
                False, self._taken_at, self._prover.source, f"cannot read: {self._error}"
            )
        try:
            return self._prover.judge(self._reading, request, self._taken_at)
        except Exception as exc:
            log_unexpected(log, f"judging {self._prover.source}", exc)
            return Residency(
                False, self._taken_at, self._prover.source, "the reading could not be judged"
            )

    async def learn(self, request: WorkRequest) -> None:
        """Runs in the background after a load: it never raises, since nothing learned
        this time is fine (the next load teaches it)."""
        with trio.move_on_after(READ_DEADLINE_S):
            try:
                await self._prover.learn(self._context, request)
            except UpstreamCallError:
                pass
            except Exception as exc:
                log_unexpected(log, f"learning from {self._prover.source}", exc)

    def _qualifies(self, not_before: float) -> bool:
        age = trio.current_time() - self._taken_at
        return self._taken_at >= not_before and age <= PROOF_MAX_AGE_S

    async def _read(self) -> None:
        """Read the server, the only read out; any failure, planned for or not, is a
        proof of nothing. A read its caller abandons changes nothing."""
        done = self._in_flight = trio.Event()
        try:
            taken_at = trio.current_time()
            reading, error = None, ""
            with trio.move_on_after(READ_DEADLINE_S) as timer:
                try:
                    reading = await self._prover.read(self._context)
                except UpstreamCallError as exc:
                    error = str(exc)
                except Exception as exc:
                    log_unexpected(log, f"reading {self._prover.source}", exc)
                    error = f"the reading failed ({type(exc).__name__})"
            if timer.cancelled_caught:
                error = f"no answer within {READ_DEADLINE_S:g}s"
            self._reading, self._error, self._taken_at = reading, error, taken_at
        finally:
            self._in_flight = None
            done.set()
