"""The reservation lifecycle, parallel lending and residency credit, without any server.

Phases are a transition table walked here in full; the ledger's sharing rules and the
credit's conditions (fresh, newer than the last job end or yield, capped by slots) run
under MockClock with proofs written by hand, so every rule has a row that fails without it.
"""

from __future__ import annotations

import itertools

import attrs
import pytest
import trio
import trio.testing

from tests.support.configs import BASIC, config_from
from vacancyd.admission import Admission, Event, Ledger, Phase, Prove, Reservation, Share
from vacancyd.admission.phases import TRANSITIONS, IllegalMove, next_phase
from vacancyd.config import UpstreamConfig
from vacancyd.decisions import DecisionLog
from vacancyd.model import (
    MIB,
    Observation,
    PresenceReading,
    PressureQuality,
    PressureView,
    Reason,
    Refuse,
    Residency,
    SessionState,
)
from vacancyd.state import SharedState

# -- the lifecycle table -------------------------------------------------------------------

ILLEGAL = None
EXPECTED: dict[Phase, dict[Event, Phase | None]] = {
    Phase.FORWARDING: {
        Event.TRACK: Phase.TRACKING,
        Event.HOLD: Phase.HELD,
        Event.END: Phase.RELEASED,
        Event.PROVEN_STOPPED: ILLEGAL,  # only a held job is proven stopped
    },
    Phase.TRACKING: {
        Event.TRACK: ILLEGAL,  # an exchange ends once
        Event.HOLD: Phase.HELD,
        Event.END: Phase.RELEASED,
        Event.PROVEN_STOPPED: ILLEGAL,
    },
    # A held job's connection ending proves nothing: only proof or an admin ends it.
    Phase.HELD: {
        Event.TRACK: Phase.HELD,
        Event.HOLD: Phase.HELD,
        Event.END: Phase.HELD,
        Event.PROVEN_STOPPED: Phase.RELEASED,
    },
    Phase.RELEASED: {
        Event.TRACK: Phase.RELEASED,
        Event.HOLD: Phase.RELEASED,
        Event.END: Phase.RELEASED,
        Event.PROVEN_STOPPED: ILLEGAL,
    },
}


@pytest.mark.parametrize(
    ("phase", "event"), list(itertools.product(Phase, Event)), ids=lambda v: v.value
)
def test_every_phase_and_event_has_its_row(phase: Phase, event: Event) -> None:
    expected = EXPECTED[phase][event]
    if expected is ILLEGAL:
        with pytest.raises(IllegalMove):
            next_phase(phase, event)
    else:
        assert next_phase(phase, event) is expected


def test_the_table_has_no_rows_beyond_the_pairs() -> None:
    assert set(TRANSITIONS) == set(itertools.product(Phase, Event))


# -- the ledger ----------------------------------------------------------------------------


def ready_state() -> SharedState:
    state = SharedState(config_from(BASIC))
    now = trio.current_time()
    state.record_presence(PresenceReading("test", now, SessionState.LOGGED_OUT))
    state.record_observation(Observation("ram", now, 32 * 1024 * MIB, 10_000 * MIB))
    state.record_observation(Observation("cpu", now, utilization_pct=10.0))
    return state


SHARE = Share("m", 2)


async def test_resident_requests_share_up_to_the_servers_slots() -> None:
    ledger = Ledger(ready_state())
    first = ledger.try_reserve("llama", ("ram",), "m", share=SHARE)
    second = ledger.try_reserve("llama", ("ram",), "m", share=SHARE)
    third = ledger.try_reserve("llama", ("ram",), "m", share=SHARE)
    assert isinstance(first, Reservation) and isinstance(second, Reservation)
    assert isinstance(third, Refuse) and third.reason is Reason.RESOURCE_BUSY
    assert "all 2 of llama's slots" in third.detail
    ledger.release(first)
    assert isinstance(ledger.try_reserve("llama", ("ram",), "m", share=SHARE), Reservation)


@pytest.mark.parametrize(
    ("upstream", "model", "share"),
    [
        ("llama", "m", None),  # a load never joins running work
        ("llama", "other", Share("other", 4)),  # nor does another model's request
        ("other", "m", Share("m", 4)),  # nor another upstream's
    ],
    ids=["load", "other-model", "other-upstream"],
)
async def test_only_the_same_resident_model_shares(
    upstream: str, model: str, share: Share | None
) -> None:
    ledger = Ledger(ready_state())
    assert isinstance(ledger.try_reserve("llama", ("ram",), "m", share=SHARE), Reservation)
    refused = ledger.try_reserve(upstream, ("ram",), model, share=share)
    assert isinstance(refused, Refuse) and refused.reason is Reason.RESOURCE_BUSY


async def test_a_resident_request_never_joins_a_load_of_another_model_or_a_hold() -> None:
    ledger = Ledger(ready_state())
    load = ledger.try_reserve("llama", ("ram",), "big")
    assert isinstance(load, Reservation)
    joined = ledger.try_reserve("llama", ("ram",), "m", share=SHARE)
    assert isinstance(joined, Refuse) and joined.reason is Reason.RESOURCE_BUSY
    ledger.hold(load, "cut on a server that keeps working")
    held = ledger.try_reserve("llama", ("ram",), "big", share=Share("big", 4))
    assert isinstance(held, Refuse) and held.reason is Reason.JOB_HELD


async def test_a_resident_request_need_not_wait_for_the_post_release_sample(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ledger = Ledger(ready_state())
    job = ledger.try_reserve("llama", ("ram",), "m")
    assert isinstance(job, Reservation)
    await trio.sleep(1)
    ledger.release(job)
    assert isinstance(ledger.try_reserve("llama", ("ram",), "m"), Refuse)
    assert isinstance(ledger.try_reserve("llama", ("ram",), "m", share=SHARE), Reservation)


async def test_a_phase_changes_only_by_the_table() -> None:
    ledger = Ledger(ready_state())
    job = ledger.try_reserve("llama", ("ram",), "m")
    assert isinstance(job, Reservation)
    ledger.track(job)
    assert job.phase is Phase.TRACKING
    ledger.hold(job, "unproven")
    ledger.release(job)  # the connection ending does not end a hold
    assert job.phase is Phase.HELD and ledger.holder("ram") is job
    assert ledger.release_hold(job.job_id, "admin") is job
    assert job.phase is Phase.RELEASED and ledger.holder("ram") is None
    ledger.hold(job, "too late")  # a released job cannot be held again
    assert job.phase is Phase.RELEASED and ledger.holder("ram") is None


async def test_an_illegal_move_raises_and_changes_nothing() -> None:
    ledger = Ledger(ready_state())
    job = ledger.try_reserve("llama", ("ram",), "m")
    assert isinstance(job, Reservation)
    ledger.track(job)
    with pytest.raises(IllegalMove, match="tracking cannot take the event track"):
        ledger.track(job)
    assert job.phase is Phase.TRACKING and ledger.holder("ram") is job


async def test_entering_a_hold_records_its_reason_and_a_second_hold_keeps_the_first() -> None:
    ledger = Ledger(ready_state())
    job = ledger.try_reserve("llama", ("ram",), "m")
    assert isinstance(job, Reservation)
    assert (job.hold_reason, job.held_since) == ("", "")
    ledger.hold(job, "cut on a server that keeps working")
    since = job.held_since
    assert job.hold_reason == "cut on a server that keeps working" and since
    ledger.hold(job, "a later reclaim")
    assert (job.hold_reason, job.held_since) == ("cut on a server that keeps working", since)


# -- residency credit in admission ---------------------------------------------------------


def upstream(**changes: object) -> UpstreamConfig:
    base = config_from(BASIC).upstream[0]
    # "big" needs 8000 MiB of ram and 9000 are spare: two loads do not fit together.
    return attrs.evolve(base, **{"resident_min_free_mib": 100, **changes})  # type: ignore[arg-type]


class Server:
    """Stands in for an adapter's proof: what the server shows, and how often it was read."""

    def __init__(self, resident: bool = True, slots: int | None = 2) -> None:
        self.resident = resident
        self.slots = slots
        self.reads = 0

    async def prove(self, not_before: float) -> Residency:
        self.reads += 1
        return Residency(
            self.resident, trio.current_time(), "/test", "the test says so", "big", self.slots
        )


def admission(state: SharedState | None = None) -> tuple[Admission, DecisionLog]:
    state = state or ready_state()
    decisions = DecisionLog(["llama"])
    return Admission(state, Ledger(state), decisions), decisions


async def test_credit_admits_a_follow_up_the_full_footprint_would_refuse() -> None:
    gate, decisions = admission()
    server = Server()
    first = await gate.admit(upstream(), "big", prove=server.prove)
    assert isinstance(first, Reservation) and not first.shared
    assert server.reads == 0  # it fitted in full: nothing asked of the server
    second = await gate.admit(upstream(), "big", prove=server.prove)
    assert isinstance(second, Reservation) and second.shared
    assert second.charged_mib == {"ram": 100}
    assert decisions.for_upstream("llama").credited == 1


async def test_no_credit_without_proof_and_the_refusal_says_why() -> None:
    gate, _ = admission()
    server = Server(resident=False)
    first = await gate.admit(upstream(), "big", prove=server.prove)
    assert isinstance(first, Reservation)
    refused = await gate.admit(upstream(), "big", prove=server.prove)
    assert isinstance(refused, Refuse) and refused.reason is Reason.RESOURCE_BUSY


async def test_credit_is_capped_by_max_concurrent() -> None:
    gate, _ = admission()
    server = Server(slots=8)
    capped = upstream(max_concurrent=2, resident_min_free_mib=500)
    jobs = [await gate.admit(capped, "big", prove=server.prove) for _ in range(3)]
    assert [type(j) for j in jobs] == [Reservation, Reservation, Refuse]
    assert isinstance(jobs[2], Refuse) and jobs[2].reason is Reason.RESOURCE_BUSY


async def test_shares_are_charged_against_what_no_reading_shows_yet() -> None:
    gate, _ = admission()
    server = Server(slots=8)
    # 9000 spare; the load's 8000 are in no reading yet, so 1000 remain for the share.
    hungry = upstream(resident_min_free_mib=2000)
    assert isinstance(await gate.admit(hungry, "big", prove=server.prove), Reservation)
    refused = await gate.admit(hungry, "big", prove=server.prove)
    assert isinstance(refused, Refuse) and refused.reason is Reason.INSUFFICIENT_CAPACITY
    assert "1000 MiB is spare" in refused.detail and "residency credit" in refused.detail


async def test_a_proof_older_than_a_yield_is_read_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    state = ready_state()
    ledger = Ledger(state)
    decisions = DecisionLog(["llama"])
    gate = Admission(state, ledger, decisions)
    stale = Residency(True, trio.current_time(), "/test", "old", "big", 2)
    calls: list[float] = []

    async def prove(not_before: float) -> Residency:
        calls.append(not_before)
        if len(calls) == 1:
            return stale
        return Residency(False, trio.current_time(), "/test", "unloaded by the yield")

    assert isinstance(await gate.admit(upstream(), "big", prove=prove), Reservation)
    await trio.sleep(1)
    ledger.note_yield(("ram",))
    refused = await gate.admit(upstream(), "big", prove=prove)
    assert isinstance(refused, Refuse)
    assert len(calls) == 2 and calls[0] == trio.current_time()


async def test_a_stale_proof_gives_no_credit(autojump_clock: trio.testing.MockClock) -> None:
    gate, decisions = admission()
    old = trio.current_time()

    async def prove(not_before: float) -> Residency:
        return Residency(True, old, "/test", "read long ago", "big", 2)

    assert isinstance(await gate.admit(upstream(), "big", prove=prove), Reservation)
    await trio.sleep(10)
    refused = await gate.admit(upstream(), "big", prove=prove)
    assert isinstance(refused, Refuse)
    residency = decisions.for_upstream("llama").residency
    assert residency is not None and residency.detail == "read long ago"


# -- ComfyUI: the server's own allocator memory --------------------------------------------


def gpu_state(free_mib: int) -> SharedState:
    state = ready_state()
    now = trio.current_time()
    state.record_observation(Observation("gpu0", now, 24_000 * MIB, free_mib * MIB))
    state.record_pressure("gpu0", PressureView(PressureQuality.READY))
    return state


def comfy(**changes: object) -> UpstreamConfig:
    fields = {"resource": "gpu0", "also_requires": [], "default_need_mib": {"gpu0": 6000}}
    return upstream(**{**fields, **changes})


def allocator(held_mib: int, at: float | None = None) -> Prove:
    async def prove(not_before: float) -> Residency:
        taken = trio.current_time() if at is None else at
        return Residency(
            False, taken, "/system_stats", f"allocator holds {held_mib} MiB", reusable_mib=held_mib
        )

    return prove


async def test_comfyuis_allocator_memory_is_added_back_to_its_one_gpu() -> None:
    gate, _ = admission(gpu_state(free_mib=4000))
    job = await gate.admit(comfy(), None, prove=allocator(3000))
    assert isinstance(job, Reservation) and not job.shared
    assert job.charged_mib == {"gpu0": 3000}


async def test_the_add_back_is_said_when_it_is_not_enough() -> None:
    gate, _ = admission(gpu_state(free_mib=4000))
    refused = await gate.admit(comfy(), None, prove=allocator(1000))
    assert isinstance(refused, Refuse) and refused.reason is Reason.INSUFFICIENT_CAPACITY
    assert "needs 5000 MiB of gpu0" in refused.detail
    assert "allocator holds 1000 MiB, added back to gpu0" in refused.detail


async def test_the_add_back_is_the_gpus_only_and_never_stale(
    autojump_clock: trio.testing.MockClock,
) -> None:
    state = gpu_state(free_mib=4000)
    gate, _ = admission(state)
    # Only the GPU gets it back: the allocator holds GPU memory, not the RAM the route needs.
    both = comfy(also_requires=["ram"], default_need_mib={"gpu0": 6000, "ram": 10})
    job = await gate.admit(both, None, prove=allocator(3000))
    assert isinstance(job, Reservation) and job.charged_mib == {"gpu0": 3000, "ram": 10}
    gate.release(job)
    old = trio.current_time()
    await trio.sleep(10)
    state.record_observation(Observation("gpu0", trio.current_time(), 24_000 * MIB, 4000 * MIB))
    state.record_observation(Observation("ram", trio.current_time(), 32 * 1024 * MIB, 10**4 * MIB))
    state.record_observation(Observation("cpu", trio.current_time(), utilization_pct=10.0))
    state.record_presence(PresenceReading("test", trio.current_time(), SessionState.LOGGED_OUT))
    state.record_pressure("gpu0", PressureView(PressureQuality.READY))
    stale = await gate.admit(comfy(), None, prove=allocator(3000, at=old))
    assert isinstance(stale, Refuse) and "stale" in stale.detail
