"""A laptop on its battery is not lent (issue 18, battery): UPower read over a real bus.

vacancyd's real PowerWatch (jeepney) reads python-dbusmock's UPower on a private system
bus (tests/support/logind.py), and a daemon in this process is driven through it: the
mains is unplugged by changing UPower's `OnBattery`, which UPower announces with
PropertiesChanged, as the real one does. Real clock; waits are on state changes under
`trio.fail_after`, and where a change must have come by signal, nothing polls.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import trio

from tests.support.configs import config_from, one_upstream_config
from tests.support.daemon import in_process_daemon
from tests.support.logind import MockLogind, mock_logind
from tests.support.upstreams import EchoUpstream
from vacancyd.edges import EdgeKind
from vacancyd.gate import decide
from vacancyd.model import ModelNeed, OwnerScope, PresenceReading, Reason, Refuse, SessionState
from vacancyd.presence.power import PowerWatch
from vacancyd.state import SharedState

pytestmark = pytest.mark.slow

CONFIG = """
[owner]
presence = "headless"
lend_on_battery = {lend}
[[resource]]
name = "ram"
kind = "memory"
[[upstream]]
name = "desk"
adapter = "llamacpp"
listen = "127.0.0.1:0"
target = "http://127.0.0.1:9"
resource = "ram"
"""


@pytest.fixture
async def bus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[MockLogind]:
    async with mock_logind(tmp_path / "bus") as mock:
        monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", mock.address)
        yield mock


@asynccontextmanager
async def watching(lend_on_battery: bool = False) -> AsyncIterator[SharedState]:
    state = SharedState(config_from(CONFIG.format(lend="true" if lend_on_battery else "false")))
    # Nobody at the machine: only power can refuse.
    state.record_presence(PresenceReading("headless", trio.current_time(), SessionState.LOGGED_OUT))
    async with trio.open_nursery() as nursery:
        await nursery.start(PowerWatch(state).run)
        yield state
        nursery.cancel_scope.cancel()


async def until(state: SharedState, on_battery: bool | None) -> None:
    with trio.fail_after(5):
        while state.power is None or state.power.on_battery is not on_battery:
            await state.wait_changed()


def refusal(state: SharedState, scope: OwnerScope = OwnerScope.HOST) -> Reason | None:
    decision = decide(state.gate_input("desk", scope, (), ModelNeed(model=None)))
    return decision.reason if isinstance(decision, Refuse) else None


async def test_a_machine_without_upower_is_not_read_and_lends_as_before(bus: MockLogind) -> None:
    async with watching() as state:
        await until(state, None)
        assert state.power is not None
        assert "no UPower on the system bus" in state.power.detail
        assert refusal(state) is None
        assert not state.edges


async def test_unplugging_refuses_host_work_and_is_a_power_edge_by_signal(
    bus: MockLogind,
) -> None:
    await bus.start_upower()
    async with watching() as state:
        await until(state, False)
        assert refusal(state) is None
        # Nothing polls: only UPower's PropertiesChanged can bring this within seconds.
        await bus.set_on_battery(True)
        await until(state, True)
        assert refusal(state) is Reason.ON_BATTERY
        assert refusal(state, OwnerScope.RESOURCE) is None  # host-scoped only
        [edge] = state.edges
        assert (edge.kind, edge.reason) == (EdgeKind.POWER, "the machine runs on its battery")
        await bus.set_on_battery(False)
        await until(state, False)
        assert refusal(state) is None
        # Plugged in again raises no edge; unplugged again raises a new one.
        await bus.set_on_battery(True)
        await until(state, True)
        assert [e.kind for e in state.edges] == [EdgeKind.POWER, EdgeKind.POWER]


async def test_an_owner_who_lends_on_battery_is_not_refused(bus: MockLogind) -> None:
    await bus.start_upower()
    await bus.set_on_battery(True)
    async with watching(lend_on_battery=True) as state:
        await until(state, True)
        assert refusal(state) is None
        assert not state.edges


async def test_upower_leaving_the_bus_makes_power_unknown_and_joining_reads_it(
    bus: MockLogind,
) -> None:
    await bus.start_upower()
    await bus.set_on_battery(True)
    async with watching() as state:
        await until(state, True)
        await bus.stop_upower()
        await until(state, None)
        assert refusal(state) is None
        await bus.start_upower()  # OnBattery false again
        await until(state, False)


async def test_a_borrowed_stream_is_cut_with_its_reason_when_the_mains_is_unplugged(
    bus: MockLogind, echo: EchoUpstream, tmp_path: Path
) -> None:
    await bus.start_upower()
    config = one_upstream_config(
        echo.url,
        tmp_path / "state",
        upstream_extra='on_owner_return = "cancel"\ndefault_need_mib = { ram = 64 }',
    )
    streaming = {"model": "m", "stream": True, "echo_stream": {"events": 3}}
    async with (
        in_process_daemon(config) as daemon,
        httpx.AsyncClient(trust_env=False, timeout=30) as client,
    ):
        proxy = daemon.proxy("echo")
        with trio.fail_after(5):
            while daemon.state.power is None or daemon.state.power.on_battery is not False:
                await daemon.state.wait_changed()
        received = b""
        async with client.stream("POST", f"{proxy}/v1/chat/completions", json=streaming) as answer:
            assert answer.status_code == 200
            chunks = answer.aiter_raw()
            received += await chunks.__anext__()
            await bus.set_on_battery(True)
            with pytest.raises(httpx.RemoteProtocolError):
                async for chunk in chunks:
                    received += chunk
        frame = json.loads(received.strip().split(b"\n\n")[-1].removeprefix(b"data: "))
        assert frame["error"]["code"] == "on_battery"
        refused = await client.post(f"{proxy}/v1/chat/completions", json={"model": "m"})
        assert refused.status_code == 503
        assert refused.headers["x-vacancyd-reason"] == "on_battery"
        assert refused.headers["retry-after"] == "300"
        power = (await client.get(f"{daemon.api}/status")).json()["power"]
        assert power["read"] is True and power["on_battery"] is True
        assert power["refuses"] == "on_battery"
        echo.gate.set()


async def test_power_is_not_read_without_a_system_bus(tmp_path: Path) -> None:
    state = SharedState(config_from(CONFIG.format(lend="false")))
    watch = PowerWatch(state, bus=f"unix:path={tmp_path / 'no-such-bus'}")
    async with trio.open_nursery() as nursery:
        await nursery.start(watch.run)
        assert state.power is not None and state.power.on_battery is None
        assert "no system bus" in state.power.detail
        nursery.cancel_scope.cancel()
