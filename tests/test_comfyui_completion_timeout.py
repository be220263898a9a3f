"""A tracked ComfyUI prompt that never completes is held at its completion timeout.

ComfyUI answers a submission with the prompt's id and runs it later, so vacancyd keeps
the borrowed job's resources and follows the prompt (proxy/tracking.py). If the prompt is
not seen to finish within `completion_timeout_s`, vacancyd cannot know it stopped, so the
resources are held durably and every borrowed request on them is refused `job_held`,
naming the resource, until an admin releases the hold.

The timing is tested under trio's autojump MockClock: the real tracker, admission, ledger
and ComfyUI actions ask the test ComfyUI (tests/support/fake_comfyui.py) about the prompt
through httpx's in-process ASGI transport, so no wait is spent on a socket and every
poll and deadline lands at its exact virtual time. A second test runs the whole daemon
on the real clock over loopback, as a borrower meets it, with a short timeout.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio
import trio.testing

from tests.support.configs import config_from, daemon_config, upstream
from tests.support.daemon import InProcessDaemon, in_process_daemon
from tests.support.fake_comfyui import FakeComfyUI, graph
from tests.support.fake_http import serve_fake
from vacancyd.adapters.actions import UpstreamContext
from vacancyd.adapters.registry import adapter_for
from vacancyd.admission import Admission, Ledger, Phase, Reservation
from vacancyd.config import Config, parse_target
from vacancyd.decisions import DecisionLog
from vacancyd.model import (
    MIB,
    RETRY_JOB_HELD,
    Observation,
    PresenceReading,
    Reason,
    Refuse,
    SessionState,
)
from vacancyd.proxy.tracking import track_job
from vacancyd.state import SharedState

POLL_S = 3.0
TIMEOUT_S = 60.0
# The ASGI transport never opens a socket; the address only has to parse.
TARGET = "http://127.0.0.1:8188"


def comfy_config(
    target: str, *, poll_s: float, timeout_s: float, state_dir: Path | None = None
) -> str:
    return daemon_config(
        upstream(
            "comfy",
            target,
            adapter="comfyui",
            completion_timeout_s=timeout_s,
            default_need_mib={"ram": 64},
        ),
        api_listen="127.0.0.1:0" if state_dir else None,
        state_dir=state_dir,
        poll_interval_s=poll_s,
    )


@attrs.define
class Rig:
    config: Config
    state: SharedState
    ledger: Ledger
    admission: Admission
    comfy: FakeComfyUI
    client: httpx.AsyncClient
    nursery: trio.Nursery

    def readings(self) -> None:
        """What the collectors would record: a fresh, roomy machine, nobody at it."""
        now = trio.current_time()
        self.state.record_observation(Observation("ram", now, 64 * 1024 * MIB, 32 * 1024 * MIB))
        self.state.record_presence(PresenceReading("test", now, SessionState.LOGGED_OUT))

    async def borrow(self) -> Reservation | Refuse:
        """What the proxy does for one submission: admit it under a prompt id of its own,
        forward it, and follow the prompt once ComfyUI has accepted it."""
        self.readings()
        prompt_id = str(uuid.uuid4())
        upstream = self.config.upstream[0]
        outcome = await self.admission.admit(upstream, None, (prompt_id,))
        if isinstance(outcome, Refuse):
            return outcome
        reply = await self.client.post(
            f"{TARGET}/prompt", json={"prompt": graph(), "prompt_id": prompt_id}
        )
        assert reply.status_code == 200 and reply.json()["prompt_id"] == prompt_id
        self.admission.track(outcome)
        actions = adapter_for("comfyui").actions
        assert actions is not None
        context = UpstreamContext(self.client, parse_target(TARGET), None)
        self.nursery.start_soon(
            track_job, self.admission, outcome, actions, context, upstream.completion_timeout_s
        )
        return outcome

    def queue_reads(self) -> int:
        """How often ComfyUI's queue was read: the tracker reads it once per poll."""
        return sum(
            1 for seen in self.comfy.seen if (seen.method, seen.target) == ("GET", b"/queue")
        )


@asynccontextmanager
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    config = config_from(comfy_config(TARGET, poll_s=POLL_S, timeout_s=TIMEOUT_S))
    state = SharedState(config)
    ledger = Ledger(state, holds_path=tmp_path / "holds.json")
    admission = Admission(state, ledger, DecisionLog(["comfy"]))
    comfy = FakeComfyUI()
    transport = httpx.ASGITransport(app=comfy)
    async with (
        httpx.AsyncClient(transport=transport, trust_env=False) as client,
        trio.open_nursery() as nursery,
    ):
        await comfy.run_background(nursery)
        yield Rig(config, state, ledger, admission, comfy, client, nursery)
        nursery.cancel_scope.cancel()


async def wait_for(state: SharedState, predicate: Callable[[], bool]) -> None:
    with trio.fail_after(10 * TIMEOUT_S):
        while not predicate():
            await state.wait_changed()


async def test_a_prompt_that_finishes_in_time_is_released(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    """The control case: the tracker does see the prompt end, so a hold in the next test
    comes from the timeout and not from a tracker that cannot read ComfyUI."""
    async with rig(tmp_path) as r:
        r.comfy.hold()
        job = await r.borrow()
        assert isinstance(job, Reservation)
        await trio.sleep(10.0)
        assert job.phase is Phase.TRACKING
        r.comfy.release()
        await wait_for(r.state, lambda: job.phase is not Phase.TRACKING)
        assert job.phase is Phase.RELEASED
        assert trio.current_time() - job.started_at <= 10.0 + POLL_S


async def test_a_prompt_that_never_finishes_is_held_at_the_completion_timeout(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    async with rig(tmp_path) as r:
        r.comfy.hold()  # the prompt runs and never ends
        job = await r.borrow()
        assert isinstance(job, Reservation)
        (prompt_id,) = job.job_ids
        started = job.started_at
        await trio.sleep_until(started + TIMEOUT_S - 0.001)
        # Up to the timeout the job is followed, once per poll, and still holds its memory.
        assert job.phase is Phase.TRACKING
        assert r.queue_reads() >= TIMEOUT_S / POLL_S - 1
        assert r.comfy.running is not None and r.comfy.running.prompt_id == prompt_id
        await wait_for(r.state, lambda: job.phase is not Phase.TRACKING)
        held_at = trio.current_time()
        assert job.phase is Phase.HELD
        assert started + TIMEOUT_S <= held_at <= started + TIMEOUT_S + POLL_S
        assert job.hold_reason == f"job {prompt_id} not seen to finish within {TIMEOUT_S:g}s"
        # vacancyd assumed nothing: the prompt was neither interrupted nor dequeued.
        assert r.comfy.interrupts == []
        assert r.comfy.running is not None and r.comfy.running.prompt_id == prompt_id

        # The next borrowed submission is refused, and the refusal names the resource.
        refused = await r.borrow()
        assert isinstance(refused, Refuse)
        assert refused.reason is Reason.JOB_HELD
        assert refused.retry_after_s == RETRY_JOB_HELD
        assert refused.resource == "ram"
        assert refused.detail.startswith("ram is held: ")
        assert prompt_id in refused.detail

        # The hold is durable: a daemon started from the same state directory keeps it.
        restarted = Ledger(SharedState(r.config), holds_path=tmp_path / "holds.json")
        assert restarted.restore_holds({"ram"}) == 1

        # Nothing re-checks a hold: the prompt ending later does not release it (only an
        # admin does; see "Current limits" in docs/architecture.md).
        r.comfy.release()
        await r.comfy.changes.wait_until(lambda: prompt_id in r.comfy.history)
        await trio.sleep(5 * POLL_S)
        assert job.phase is Phase.HELD
        assert r.ledger.release_hold(job.job_id, "released by the test") is job
        assert job.phase is Phase.RELEASED


# -- the same through the daemon, as a borrower meets it (real clock, loopback) -----------


async def status_when(
    http: httpx.AsyncClient,
    daemon: InProcessDaemon,
    predicate: Callable[[dict[str, Any]], bool],
    within_s: float = 15.0,
) -> dict[str, Any]:
    """/status once `predicate` holds, read again after each change of the daemon's state."""
    document: dict[str, Any] = {}
    with trio.move_on_after(within_s):
        while True:
            document = (await http.get(f"{daemon.api}/status")).json()
            if predicate(document):
                return document
            await daemon.state.wait_changed()
    raise AssertionError(f"/status never got there:\n{json.dumps(document, indent=2)}")


def comfy_work(document: dict[str, Any]) -> list[dict[str, Any]]:
    work: list[dict[str, Any]] = document["upstreams"]["comfy"]["active_work"]
    return work


async def test_a_borrower_meets_the_hold_after_the_timeout(tmp_path: Path) -> None:
    """Through the proxy: the prompt is accepted, never completes, and once the (short)
    timeout has passed the next submission gets 503 job_held naming the resource."""
    timeout_s = 0.5
    async with (
        serve_fake(FakeComfyUI()) as comfy,
        httpx.AsyncClient(trust_env=False, timeout=15) as http,
    ):
        comfy.hold()
        text = comfy_config(comfy.url, poll_s=0.1, timeout_s=timeout_s, state_dir=tmp_path / "s")
        async with in_process_daemon(text) as daemon:
            submit = partial(http.post, f"{daemon.proxy('comfy')}/prompt", json={"prompt": graph()})
            accepted = await submit()
            assert accepted.status_code == 200, accepted.text
            prompt_id = accepted.json()["prompt_id"]
            tracking = await status_when(http, daemon, lambda d: bool(comfy_work(d)))
            assert comfy_work(tracking)[0]["job_ids"] == [prompt_id]
            held = await status_when(
                http, daemon, lambda d: [w["phase"] for w in comfy_work(d)] == ["held"]
            )
            assert comfy_work(held)[0]["hold_reason"] == (
                f"job {prompt_id} not seen to finish within {timeout_s:g}s"
            )
            refused = await submit()
            assert refused.status_code == 503
            assert refused.headers["x-vacancyd-reason"] == "job_held"
            assert refused.headers["retry-after"] == str(RETRY_JOB_HELD)
            assert "ram is held" in refused.text and prompt_id in refused.text
            assert comfy.running is not None and comfy.running.prompt_id == prompt_id
            assert comfy.interrupts == []
            assert len(comfy.submitted) == 1  # the refused one never reached ComfyUI
