"""Reclaim under trio's MockClock: deadlines, coalescing, stand-down, scoping, holds.

The relay handles here stand in for the proxy's connections (the proxy registers a real
one per admitted job); everything else is the real state, ledger and reclaim task.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import httpx
import trio
import trio.testing

from tests.support.configs import config_from
from vacancyd.adapters.actions import CancelReport, JobState, UnloadReport, UpstreamContext
from vacancyd.adapters.registry import adapter_for
from vacancyd.admission import Ledger, Phase, Reservation
from vacancyd.config import Config
from vacancyd.model import (
    MIB,
    Observation,
    PresenceReading,
    PressureQuality,
    PressureView,
    Reason,
    Refuse,
    SessionState,
)
from vacancyd.reclaim import UpstreamReclaim
from vacancyd.state import SharedState


def reclaim_config(
    policy: str = "drain", *, scope: str = "host", release_after: float = 5.0
) -> Config:
    return config_from(
        f"""
[owner]
presence = "headless"
release_after_s = {release_after}
[[resource]]
name = "ram"
kind = "memory"
[[resource]]
name = "gpu0"
kind = "nvidia_gpu"
device = 0
[[resource]]
name = "gpu1"
kind = "nvidia_gpu"
device = 1
[[upstream]]
name = "a"
adapter = "llamacpp"
listen = "127.0.0.1:0"
target = "http://127.0.0.1:9"
resource = "gpu0"
on_owner_return = "{policy}"
drain_timeout_s = 30.0
completion_timeout_s = 600.0
owner_scope = "{scope}"
[[upstream]]
name = "b"
adapter = "llamacpp"
listen = "127.0.0.1:0"
target = "http://127.0.0.1:9"
resource = "gpu1"
owner_scope = "{scope}"
"""
    )


@attrs.define
class RecordingRelay:
    """Stands in for a proxied connection: records when and why reclaim cut it."""

    cut_at: float | None = None
    refusal: Refuse | None = None

    def cancel(self, refusal: Refuse) -> bool:
        self.cut_at = trio.current_time()
        self.refusal = refusal
        return True


@attrs.define
class Rig:
    state: SharedState
    ledger: Ledger
    reclaims: dict[str, UpstreamReclaim]

    def admit(self, upstream: str, resource: str) -> tuple[Reservation, RecordingRelay]:
        reservation = self.ledger.try_reserve(upstream, (resource,), None)
        assert isinstance(reservation, Reservation)
        relay = RecordingRelay()
        self.ledger.attach(reservation, relay)
        return reservation, relay

    def presence(self, session: SessionState) -> None:
        self.state.record_presence(PresenceReading("test", trio.current_time(), session))

    def pressure_clear(self, *resources: str) -> None:
        for name in resources:
            self.state.record_pressure(name, PressureView(PressureQuality.READY))


@asynccontextmanager
async def rig(config: Config) -> AsyncIterator[Rig]:
    state = SharedState(config)
    ledger = Ledger(state)
    now = trio.current_time()
    for name in ("gpu0", "gpu1"):
        state.record_observation(Observation(name, now, 8192 * MIB, 8000 * MIB))
    state.record_presence(PresenceReading("test", now, SessionState.LOGGED_OUT))
    reclaims = {
        u.name: UpstreamReclaim(u, adapter_for(u.adapter.value), state, ledger, None, None)
        for u in config.upstream
    }
    async with trio.open_nursery() as nursery:
        for reclaim in reclaims.values():
            await nursery.start(reclaim.run)
        yield Rig(state, ledger, reclaims)
        nursery.cancel_scope.cancel()


async def test_drain_cuts_exactly_at_the_drain_timeout_after_the_first_edge(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with rig(reclaim_config("drain")) as r:
        _, relay = r.admit("a", "gpu0")
        await trio.sleep(1.0)
        returned = trio.current_time()
        r.presence(SessionState.ACTIVE)
        await trio.sleep(29.999)
        assert relay.cut_at is None, "cut before the drain deadline"
        await trio.sleep(0.002)
        assert relay.cut_at == returned + 30.0
        assert relay.refusal is not None and relay.refusal.reason is Reason.OWNER_ACTIVE
        record = r.reclaims["a"].last
        assert record is not None and record.phase == "done" and record.cancelled_jobs


class Wakeups(trio.abc.Instrument):
    """Counts how often trio schedules the reclaim tasks: each wake is one schedule."""

    def __init__(self) -> None:
        self.count = 0

    def task_scheduled(self, task: trio.lowlevel.Task) -> None:
        if task.name.endswith("UpstreamReclaim.run"):
            self.count += 1


async def test_an_idle_reclaim_is_woken_by_edges_not_by_every_reading(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Readings arrive every poll on every resource; an idle reclaim has nothing to do
    with them. Before, each one woke every upstream's reclaim to look for edges."""
    async with rig(reclaim_config("drain")) as r:
        _, relay = r.admit("a", "gpu0")
        wakeups = Wakeups()
        trio.lowlevel.add_instrument(wakeups)
        try:
            for _ in range(100):
                now = trio.current_time()
                r.state.record_observation(Observation("gpu0", now, 8192 * MIB, 8000 * MIB))
                await trio.sleep(1.0)
            assert wakeups.count == 0
            r.presence(SessionState.ACTIVE)  # an edge: the reclaim wakes and drains
            await trio.sleep(31.0)
        finally:
            trio.lowlevel.remove_instrument(wakeups)
        assert wakeups.count > 0 and relay.cut_at is not None


async def test_a_second_owner_return_does_not_move_the_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # gpu0 has no pressure reading, so the reclaim cannot stand down when the owner leaves.
    async with rig(reclaim_config("drain", release_after=2.0)) as r:
        _, relay = r.admit("a", "gpu0")
        first = trio.current_time()
        r.presence(SessionState.ACTIVE)
        await trio.sleep(3.0)
        r.presence(SessionState.LOGGED_OUT)  # released: 3 s after the last match
        assert not r.state.veto.engaged
        await trio.sleep(7.0)
        r.presence(SessionState.ACTIVE)  # a second rising edge at first + 10
        await trio.sleep(25.0)
        assert relay.cut_at == first + 30.0
        record = r.reclaims["a"].last
        assert record is not None and record.edges == [first, first + 10.0]


async def test_cancel_acts_at_once(autojump_clock: trio.testing.MockClock) -> None:
    async with rig(reclaim_config("cancel")) as r:
        _, relay = r.admit("a", "gpu0")
        returned = trio.current_time()
        r.presence(SessionState.ACTIVE)
        await trio.sleep(0.001)
        assert relay.cut_at == returned


async def test_finish_never_cuts_and_ends_when_the_work_does(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with rig(reclaim_config("finish")) as r:
        job, relay = r.admit("a", "gpu0")
        r.presence(SessionState.ACTIVE)
        await trio.sleep(500.0)
        assert relay.cut_at is None
        assert r.reclaims["a"].current is not None
        r.ledger.release(job)
        await trio.sleep(0.001)
        record = r.reclaims["a"].last
        assert relay.cut_at is None and record is not None and not record.cancelled_jobs
        assert record.phase == "done"


async def test_an_owner_who_leaves_before_the_deadline_makes_it_stand_down(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with rig(reclaim_config("drain", release_after=5.0)) as r:
        r.pressure_clear("gpu0")
        _, relay = r.admit("a", "gpu0")
        r.presence(SessionState.ACTIVE)
        await trio.sleep(1.0)
        r.presence(SessionState.LOGGED_OUT)
        await trio.sleep(5.0)
        r.presence(SessionState.LOGGED_OUT)  # 6 s after the match: the veto releases
        r.pressure_clear("gpu0")
        await trio.sleep(40.0)
        assert relay.cut_at is None
        record = r.reclaims["a"].last
        assert record is not None and record.phase == "stood_down"
        assert not record.cancelled_jobs


async def test_a_pressure_edge_leaves_an_upstream_on_another_resource_alone(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with rig(reclaim_config("drain")) as r:
        _, relay_a = r.admit("a", "gpu0")
        _, relay_b = r.admit("b", "gpu1")
        edge_at = trio.current_time()
        r.state.add_edge("pressure", edge_at, "owner load 80% over 30%", "gpu0")
        await trio.sleep(31.0)
        assert relay_a.cut_at == edge_at + 30.0
        assert relay_a.refusal is not None
        assert relay_a.refusal.reason is Reason.RESOURCE_PRESSURED
        assert relay_b.cut_at is None
        assert r.reclaims["b"].last is None and r.reclaims["b"].current is None


async def test_a_resource_scoped_upstream_ignores_the_owner(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with rig(reclaim_config("cancel", scope="resource")) as r:
        _, relay = r.admit("a", "gpu0")
        r.presence(SessionState.ACTIVE)
        await trio.sleep(60.0)
        assert relay.cut_at is None
        assert r.reclaims["a"].last is None
        # ... but its resources' pressure still reclaims it, even while the veto stands.
        r.state.add_edge("pressure", trio.current_time(), "owner load", "gpu0")
        await trio.sleep(0.001)
        assert relay.cut_at is not None


async def test_work_admitted_after_the_edge_is_not_named(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with rig(reclaim_config("cancel")) as r:
        r.state.add_edge("pressure", trio.current_time(), "owner load", "gpu0")
        await trio.sleep(1.0)
        _, relay = r.admit("a", "gpu0")
        await trio.sleep(10.0)
        assert relay.cut_at is None


async def test_a_durable_hold_survives_a_restart_until_released(tmp_path: Path) -> None:
    config = reclaim_config()
    state = SharedState(config)
    ledger = Ledger(state, holds_path=tmp_path / "holds.json")
    job = ledger.try_reserve("a", ("gpu0",), "m")
    assert isinstance(job, Reservation)
    ledger.hold(job, "cannot prove the job stopped")
    ledger.release(job)  # the connection ended: not proof
    assert ledger.holder("gpu0") is job
    assert (tmp_path / "holds.json").stat().st_mode & 0o777 == 0o600

    restarted_state = SharedState(config)
    restarted = Ledger(restarted_state, holds_path=tmp_path / "holds.json")
    assert restarted.restore_holds(set(restarted_state.resources)) == 1
    refused = restarted.try_reserve("a", ("gpu0",), None)
    assert isinstance(refused, Refuse) and refused.reason is Reason.JOB_HELD
    assert "held: cannot prove the job stopped" in refused.detail
    [held] = restarted.statistics().entries
    assert held.phase is Phase.HELD
    assert restarted.release_hold(held.job_id, "admin") is held
    assert restarted.holder("gpu0") is None
    assert restarted.awaits_sample("gpu0"), "a released hold still needs a fresh sample"
    third = Ledger(SharedState(config), holds_path=tmp_path / "holds.json")
    assert third.restore_holds({"gpu0"}) == 0


async def test_a_corrupt_holds_file_is_reported_and_ignored(tmp_path: Path) -> None:
    (tmp_path / "holds.json").write_text('{"vacancyd_state": "holds", "version": 1, "data": 5}')
    ledger = Ledger(SharedState(reclaim_config()), holds_path=tmp_path / "holds.json")
    assert ledger.restore_holds({"gpu0"}) == 0
    (tmp_path / "holds.json").write_text("not json")
    assert ledger.restore_holds({"gpu0"}) == 0


@attrs.frozen
class UnplannedFailures:
    """An adapter's reclaim calls failing in a way no adapter plans for (the real ones
    turn every upstream failure into a report; this is what the guard is for)."""

    async def unload(self, ctx: UpstreamContext, ours: frozenset[str]) -> UnloadReport:
        raise RuntimeError("unplanned")

    async def cancel_jobs(self, ctx: UpstreamContext, job_ids: frozenset[str]) -> CancelReport:
        raise RuntimeError("unplanned")

    async def job_state(self, ctx: UpstreamContext, job_id: str) -> JobState:
        raise RuntimeError("unplanned")


async def test_a_reclaim_call_that_fails_unexpectedly_holds_the_job_and_keeps_reclaiming(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Cancelling and unloading run inside the reclaim task, which is essential: an error
    there used to end the task, and the daemon with it. Now the jobs it was about are held
    (none is proved stopped), the unload is reported unconfirmed, and the next edge is
    reclaimed as usual."""
    config = reclaim_config("cancel")
    upstream = config.upstream[0]
    adapter = attrs.evolve(adapter_for("comfyui"), actions=UnplannedFailures())
    state = SharedState(config)
    ledger = Ledger(state)
    now = trio.current_time()
    state.record_observation(Observation("gpu0", now, 8192 * MIB, 8000 * MIB))
    state.record_presence(PresenceReading("test", now, SessionState.LOGGED_OUT))
    async with httpx.AsyncClient() as client, trio.open_nursery() as nursery:
        reclaim = UpstreamReclaim(upstream, adapter, state, ledger, client, None)
        await nursery.start(reclaim.run)
        job = ledger.try_reserve("a", ("gpu0",), None, job_ids=("p-1",))
        assert isinstance(job, Reservation)
        ledger.attach(job, RecordingRelay())
        state.record_presence(PresenceReading("test", trio.current_time(), SessionState.ACTIVE))
        await trio.sleep(1.0)
        record = reclaim.last
        assert record is not None and record.phase == "done"
        assert record.upstream_cancel == "error: the cancellation failed (RuntimeError)"
        assert record.unload.startswith("error: the unload failed (RuntimeError)")
        assert job.phase is Phase.HELD and "RuntimeError" in job.hold_reason
        # Still reclaiming: the owner leaves, comes back, and the next edge is answered.
        state.record_presence(PresenceReading("test", trio.current_time(), SessionState.LOGGED_OUT))
        await trio.sleep(10.0)
        state.record_presence(PresenceReading("test", trio.current_time(), SessionState.LOGGED_OUT))
        state.record_presence(PresenceReading("test", trio.current_time(), SessionState.ACTIVE))
        await trio.sleep(1.0)
        assert reclaim.last is not record
        nursery.cancel_scope.cancel()
