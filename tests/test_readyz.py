"""/readyz: every condition that keeps the daemon from being ready, and the ready case.

A load balancer or systemd-style probe sends traffic only once /readyz says 200, so each
condition in `is_ready` matters on its own: all listeners bound, a presence reading, that
reading fresh, and a fresh capacity reading for every resource some upstream needs and
whose switch is on. Resources no upstream uses, or that the owner switched off, must not
hold readiness back.

The real API app is served by the daemon's own listener (serving.serve_app) on loopback,
in front of a real `SharedState` and `Published` that the test writes into the way the
collectors and the service do. That way each condition can be set alone, which a running
daemon cannot show: it binds the API listener last and its collectors keep writing.

Freshness is judged on trio's clock, so the clock is a MockClock the test moves by hand
(`jump`): the boundary (a reading exactly as old as the bound still counts) is checked
exactly. Its autojump threshold is far above any real socket exchange here; it only
matters if something hangs, when the clock then runs to the guard deadline and fails the
test instead of blocking it.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import attrs
import httpx
import pytest
import trio
import trio.testing

from tests.support.configs import config_from
from vacancyd.admission import Ledger
from vacancyd.api.app import create_api_app
from vacancyd.api.parts import DaemonParts
from vacancyd.auth import Authenticator
from vacancyd.config import parse_listen
from vacancyd.decisions import DecisionLog
from vacancyd.model import MIB, Observation, PresenceReading, SessionState
from vacancyd.published import BoundListeners, Published
from vacancyd.serving import serve_app
from vacancyd.state import SharedState

GUARD_S = 60.0

CONFIG = f"""
[server]
api_listen = "127.0.0.1:0"
poll_interval_s = 3.0
[auth]
trust_loopback = false
[[auth.tokens]]
name = "reader"
scopes = ["read"]
sha256 = "{hashlib.sha256(b"read-token-0123456789").hexdigest()}"
[owner]
presence = "headless"
[[resource]]
name = "ram"
kind = "memory"
[[resource]]
name = "cpu"
kind = "cpu"
enabled = false
[[resource]]
name = "scratch"
kind = "memory"
[[upstream]]
name = "llama"
adapter = "llamacpp"
listen = "127.0.0.1:0"
target = "http://127.0.0.1:9"
resource = "ram"
also_requires = ["cpu"]
"""


@pytest.fixture
def hand_clock() -> trio.testing.MockClock:
    """Moves only when the test jumps it (or, after a hang, when the test must fail)."""
    return trio.testing.MockClock(autojump_threshold=5.0)


@attrs.define
class Rig:
    state: SharedState
    listeners: BoundListeners
    http: httpx.AsyncClient
    url: str

    async def ready(self) -> bool:
        """What /readyz says, checked for its public, detail-free shape."""
        with trio.fail_after(GUARD_S):
            answer = await self.http.get(f"{self.url}/readyz")
        body = answer.json()
        assert body == {"ready": answer.status_code == 200}, (answer.status_code, body)
        assert answer.status_code in (200, 503)
        return bool(body["ready"])

    def presence(self) -> None:
        now = trio.current_time()
        self.state.record_presence(PresenceReading("headless", now, SessionState.LOGGED_OUT))

    def capacity(self, name: str) -> None:
        now = trio.current_time()
        if name == "cpu":
            self.state.record_observation(Observation(name, now, utilization_pct=5.0))
        else:
            self.state.record_observation(Observation(name, now, 64 * 1024 * MIB, 8 * 1024 * MIB))

    def all_bound(self) -> None:
        self.listeners.record("llama", ["http://127.0.0.1:1"])
        self.listeners.mark_complete()

    def everything_fresh(self) -> None:
        self.all_bound()
        self.presence()
        self.capacity("ram")


@asynccontextmanager
async def api() -> AsyncIterator[Rig]:
    config = config_from(CONFIG)
    state = SharedState(config)
    listeners = BoundListeners()
    published = Published(listeners=listeners)
    app = create_api_app(
        DaemonParts(
            state=state,
            published=published,
            ledger=Ledger(state),
            decisions=DecisionLog(["llama"]),
            auth=Authenticator(config.auth),
        )
    )
    limits = config.server.limits
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        bound = await nursery.start(
            partial(
                serve_app,
                app,
                parse_listen(config.server.api_listen),
                limits,
                grace_s=1.0,
                shutdown_trigger=stop.wait,
                date_header=True,
            )
        )
        listeners.record("api", bound)  # as the service records it; not complete yet
        # A fresh connection per request: a jump of the clock may expire an idle one.
        no_reuse = httpx.Limits(max_keepalive_connections=0)
        async with httpx.AsyncClient(trust_env=False, timeout=None, limits=no_reuse) as http:
            yield Rig(state, listeners, http, bound[0])
        nursery.cancel_scope.cancel()


async def test_ready_once_listeners_presence_and_needed_resources_are_in(
    hand_clock: trio.testing.MockClock,
) -> None:
    async with api() as rig:
        rig.everything_fresh()
        assert await rig.ready()


async def test_not_ready_until_every_listener_is_bound(
    hand_clock: trio.testing.MockClock,
) -> None:
    async with api() as rig:
        rig.presence()
        rig.capacity("ram")
        # The API itself answers, but an upstream's port is not bound yet: a gateway told
        # "ready" now would send borrowers to a port that refuses them.
        assert not await rig.ready()
        rig.listeners.record("llama", ["http://127.0.0.1:1"])
        assert not await rig.ready()
        rig.listeners.mark_complete()
        assert await rig.ready()


async def test_not_ready_before_the_first_presence_reading(
    hand_clock: trio.testing.MockClock,
) -> None:
    async with api() as rig:
        rig.all_bound()
        rig.capacity("ram")
        assert not await rig.ready()
        rig.presence()
        assert await rig.ready()


async def test_a_presence_reading_older_than_the_freshness_bound_is_not_ready(
    hand_clock: trio.testing.MockClock,
) -> None:
    async with api() as rig:
        rig.everything_fresh()
        bound = rig.state.freshness_s
        hand_clock.jump(bound - 1.0)
        rig.capacity("ram")  # keep capacity fresh: only presence ages past the bound
        hand_clock.jump(1.0)
        assert await rig.ready(), "a reading exactly as old as the bound is still fresh"
        hand_clock.jump(0.001)
        assert not await rig.ready()
        rig.presence()
        assert await rig.ready()


async def test_a_needed_resource_must_have_a_fresh_reading(
    hand_clock: trio.testing.MockClock,
) -> None:
    async with api() as rig:
        rig.all_bound()
        rig.presence()
        assert not await rig.ready(), "ram was never read"
        rig.capacity("ram")
        assert await rig.ready()
        bound = rig.state.freshness_s
        hand_clock.jump(bound - 1.0)
        rig.presence()
        hand_clock.jump(1.001)  # ram is now just past the bound, presence is not
        assert not await rig.ready()
        rig.capacity("ram")
        assert await rig.ready()
        # A collector that says it cannot read the resource makes it unknown at once,
        # however recent the last good reading.
        rig.state.mark_unavailable("ram", "probe timed out")
        assert not await rig.ready()
        rig.capacity("ram")
        assert await rig.ready()


async def test_switched_off_and_unused_resources_do_not_hold_readiness_back(
    hand_clock: trio.testing.MockClock,
) -> None:
    async with api() as rig:
        # cpu is needed but switched off in the config, scratch is used by no upstream;
        # neither has ever been read.
        rig.everything_fresh()
        assert await rig.ready()
        # Switched on, cpu is needed again and its missing reading counts.
        rig.state.set_resource_switch("cpu", True)
        assert not await rig.ready()
        rig.capacity("cpu")
        assert await rig.ready()


async def test_readyz_needs_no_token_where_status_does(
    hand_clock: trio.testing.MockClock,
) -> None:
    async with api() as rig:
        rig.everything_fresh()
        assert await rig.ready()  # no Authorization header, loopback not trusted
        status = await rig.http.get(f"{rig.url}/status")
        assert status.status_code == 401
