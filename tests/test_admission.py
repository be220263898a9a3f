"""The admission ledger and the gate-then-ledger admission step, under MockClock."""

from __future__ import annotations

import trio
import trio.testing

from tests.support.configs import BASIC, config_from
from vacancyd.admission import Admission, Ledger, Reservation, need_for
from vacancyd.decisions import DecisionLog
from vacancyd.model import MIB, Observation, PresenceReading, Reason, Refuse, SessionState
from vacancyd.state import SharedState


def _ready_state() -> SharedState:
    state = SharedState(config_from(BASIC))
    now = trio.current_time()
    state.record_presence(PresenceReading("test", now, SessionState.LOGGED_OUT))
    state.record_observation(Observation("ram", now, 32 * 1024 * MIB, 10_000 * MIB))
    state.record_observation(Observation("cpu", now, utilization_pct=10.0))
    return state


async def test_one_job_per_resource_across_upstreams() -> None:
    state = _ready_state()
    ledger = Ledger(state)
    first = ledger.try_reserve("llama", ("ram", "cpu"), "m")
    assert isinstance(first, Reservation)
    second = ledger.try_reserve("other", ("cpu",), None)
    assert isinstance(second, Refuse)
    assert (second.reason, second.retry_after_s, second.resource) == (
        Reason.RESOURCE_BUSY,
        2,
        "cpu",
    )
    assert "upstream llama" in second.detail
    assert ledger.statistics().busy_refusals == {"other": 1}


async def test_released_resource_waits_for_a_sample_taken_after_release(
    autojump_clock: trio.testing.MockClock,
) -> None:
    state = _ready_state()
    ledger = Ledger(state)
    job = ledger.try_reserve("llama", ("ram",), None)
    assert isinstance(job, Reservation)
    await trio.sleep(1.0)
    ledger.release(job)
    assert ledger.awaits_sample("ram")
    again = ledger.try_reserve("llama", ("ram",), None)
    assert isinstance(again, Refuse) and again.reason is Reason.RESOURCE_BUSY
    assert "after it" in again.detail
    # A reading taken at the very moment of release is not after it.
    state.record_observation(Observation("ram", trio.current_time(), 32 * 1024 * MIB, MIB))
    assert ledger.awaits_sample("ram")
    await trio.sleep(0.5)
    state.record_observation(Observation("ram", trio.current_time(), 32 * 1024 * MIB, MIB))
    assert not ledger.awaits_sample("ram")
    assert isinstance(ledger.try_reserve("llama", ("ram",), None), Reservation)


async def test_release_asks_the_collector_for_a_sample() -> None:
    state = _ready_state()
    ledger = Ledger(state)
    job = ledger.try_reserve("llama", ("ram",), None)
    assert isinstance(job, Reservation)
    with trio.move_on_after(1) as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(state.wait_sample_requested, state.sample_requests)
            await trio.testing.wait_all_tasks_blocked()
            ledger.release(job)
    assert not scope.cancelled_caught


async def test_wait_post_release_sample_returns_when_the_sample_lands(
    autojump_clock: trio.testing.MockClock,
) -> None:
    state = _ready_state()
    ledger = Ledger(state)
    job = ledger.try_reserve("llama", ("ram",), None)
    assert isinstance(job, Reservation)
    ledger.release(job)

    async def collector() -> None:
        await state.wait_sample_requested(0)
        await trio.sleep(0.3)
        state.record_observation(Observation("ram", trio.current_time(), MIB, MIB))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(collector)
        started = trio.current_time()
        await ledger.wait_post_release_sample(("ram",), timeout_s=2.0)
    assert trio.current_time() - started == 0.3
    assert not ledger.awaits_sample("ram")


async def test_wait_post_release_sample_gives_up_at_its_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    state = _ready_state()
    ledger = Ledger(state)
    job = ledger.try_reserve("llama", ("ram",), None)
    assert isinstance(job, Reservation)
    ledger.release(job)
    started = trio.current_time()
    await ledger.wait_post_release_sample(("ram",), timeout_s=2.0)
    assert trio.current_time() - started == 2.0
    assert ledger.awaits_sample("ram")


def test_need_for_uses_the_model_table_then_the_default() -> None:
    config = config_from(BASIC)
    upstream = config.upstream[0]
    resources = {r.name: r for r in config.resource}
    assert need_for(upstream, resources, "big").need_mib == {"ram": 8000}
    assert need_for(upstream, resources, "small").need_mib == {"ram": 500}
    assert need_for(upstream, resources, None).need_mib == {"ram": 500}


async def test_admission_refuses_then_records_what_the_gate_saw() -> None:
    state = _ready_state()
    decisions = DecisionLog(["llama"])
    admission = Admission(state, Ledger(state), decisions)
    upstream = config_from(BASIC).upstream[0]
    # 10000 MiB free minus 1000 kept leaves 9000 spare: "big" (8000) fits.
    job = await admission.admit(upstream, "big")
    assert isinstance(job, Reservation)
    busy = await admission.admit(upstream, "big")
    assert isinstance(busy, Refuse) and busy.reason is Reason.RESOURCE_BUSY
    admission.release(job)
    later = trio.current_time() + 1
    state.record_observation(Observation("ram", later, MIB, 5000 * MIB))
    state.record_observation(Observation("cpu", later, utilization_pct=10.0))
    short = await admission.admit(upstream, "big")
    assert isinstance(short, Refuse) and short.reason is Reason.INSUFFICIENT_CAPACITY
    assert "big needs 8000 MiB of ram (configured footprint), 4000 MiB is spare" in short.detail
    record = decisions.for_upstream("llama")
    assert record.admitted == 1
    assert record.refused == {"resource_busy": 1, "insufficient_capacity": 1}
    assert record.last is not None and record.last.question is not None
    ram = record.last.question.resources[0]
    assert (ram.name, ram.spare_mib) == ("ram", 4000)


async def test_admission_is_refused_by_lending_switch_before_the_ledger() -> None:
    state = _ready_state()
    state.set_lending(False)
    admission = Admission(state, Ledger(state), DecisionLog(["llama"]))
    outcome = await admission.admit(config_from(BASIC).upstream[0], None)
    assert isinstance(outcome, Refuse) and outcome.reason is Reason.LENDING_DISABLED
    assert outcome.retry_after_s == 300


async def test_a_sample_asked_after_the_whole_answer_counts_as_post_release(
    autojump_clock: trio.testing.MockClock,
) -> None:
    state = _ready_state()
    ledger = Ledger(state)
    job = ledger.try_reserve("llama", ("ram",), None)
    assert isinstance(job, Reservation)
    await trio.sleep(1.0)
    asked = state.sample_requests
    ledger.answered(job)
    assert state.sample_requests == asked + 1  # asked for while the answer is written
    await trio.sleep(0.1)
    state.record_observation(Observation("ram", trio.current_time(), 32 * 1024 * MIB, MIB))
    await trio.sleep(0.1)
    ledger.release(job)
    assert state.sample_requests == asked + 1  # the release asks for no second sample
    assert not ledger.awaits_sample("ram")
    assert isinstance(ledger.try_reserve("llama", ("ram",), None), Reservation)


async def test_a_reading_from_before_the_whole_answer_still_does_not_count(
    autojump_clock: trio.testing.MockClock,
) -> None:
    state = _ready_state()
    ledger = Ledger(state)
    job = ledger.try_reserve("llama", ("ram",), None)
    assert isinstance(job, Reservation)
    await trio.sleep(1.0)
    state.record_observation(Observation("ram", trio.current_time(), 32 * 1024 * MIB, MIB))
    await trio.sleep(0.1)
    ledger.answered(job)
    ledger.release(job)
    assert ledger.awaits_sample("ram")


async def test_the_answer_of_a_job_the_upstream_runs_on_does_not_end_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    state = _ready_state()
    ledger = Ledger(state)
    job = ledger.try_reserve("comfy", ("ram",), None, job_ids=("prompt-1",))
    assert isinstance(job, Reservation)
    ledger.answered(job)  # the prompt was queued, not run: nothing to sample yet
    assert job.answered_at is None
    ledger.track(job)
    await trio.sleep(5.0)
    state.record_observation(Observation("ram", trio.current_time(), 32 * 1024 * MIB, MIB))
    await trio.sleep(1.0)
    ledger.release(job)
    assert ledger.awaits_sample("ram")  # the reading taken while it ran does not count


async def test_waiting_for_the_post_release_sample_asks_for_no_more_samples(
    autojump_clock: trio.testing.MockClock,
) -> None:
    state = _ready_state()
    ledger = Ledger(state)
    job = ledger.try_reserve("llama", ("ram",), None)
    assert isinstance(job, Reservation)
    ledger.release(job)
    asked = state.sample_requests  # the release asked for one

    async def collector() -> None:
        await trio.sleep(0.1)
        state.notify()  # some other change first: not a reason to ask again
        await trio.sleep(0.1)
        state.record_observation(Observation("ram", trio.current_time(), 32 * 1024 * MIB, MIB))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(collector)
        await ledger.wait_post_release_sample(("ram",), timeout_s=2.0)
    assert not ledger.awaits_sample("ram")
    assert state.sample_requests == asked
