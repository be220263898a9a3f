"""The supervision tree: a failure in any branch ends the daemon by name, and shutdown
drains the listeners before reclaim and the collectors are cancelled.

These run the real daemon (real branches, listeners, collectors and reclaim tasks) and
add small components to chosen branches through `extra_components`: one that fails, or
one that only notes when it is cancelled. The shutdown tests run on a MockClock that
stands still unless the test moves it, so the drain can only end when the test lets the
held response finish or jumps past the grace period; the sockets are real, and waiting
on them moves no time.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import trio
import trio.testing

from tests.support.daemon import InProcessDaemon, daemon_process
from vacancyd.config import parse_config
from vacancyd.service import run_daemon
from vacancyd.supervision import BRANCHES, EssentialTaskFailed

BODY_HEAD, BODY_TAIL = b"first", b"-last"


def config_text(
    tmp_path: Path,
    *,
    api: str = "127.0.0.1:0",
    listen: str = "127.0.0.1:0",
    target: str = "http://127.0.0.1:9",
    grace_s: float = 10.0,
) -> str:
    return f"""
[server]
api_listen = "{api}"
state_dir = "{tmp_path / "state"}"
shutdown_grace_s = {grace_s}
[owner]
presence = "headless"
[[resource]]
name = "ram"
kind = "memory"
[[upstream]]
name = "llama"
adapter = "llamacpp"
listen = "{listen}"
target = "{target}"
resource = "ram"
"""


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


async def _run_until_it_fails(
    text: str, extra: dict[str, Callable[..., Awaitable[Any]]], ready: trio.Event
) -> EssentialTaskFailed:
    """Run the daemon, set `ready` once it is, and wait for it to fail; return the one
    failure it names."""
    config = parse_config(text)
    with (
        trio.fail_after(20),
        pytest.RaisesGroup(EssentialTaskFailed, flatten_subgroups=True) as caught,
    ):
        async with trio.open_nursery() as nursery:
            await nursery.start(
                partial(run_daemon, config, extra_components=extra, handle_signals=False)
            )
            ready.set()
            await trio.sleep_forever()  # the daemon's failure ends this
    failures = [e for e in _leaves(caught.value) if isinstance(e, EssentialTaskFailed)]
    assert len(failures) == 1
    return failures[0]


@pytest.mark.parametrize("branch", BRANCHES)
async def test_a_component_failing_in_any_branch_ends_the_daemon_naming_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, branch: str
) -> None:
    """The failure leaves its branch and the root; every sibling branch is cancelled."""

    ready = trio.Event()

    async def failing(*, task_status: trio.TaskStatus[None]) -> None:
        task_status.started()
        await ready.wait()  # fail once the daemon serves, not while it starts
        raise RuntimeError("it broke")

    name = f"probe:{branch}"
    failed = await _run_until_it_fails(config_text(tmp_path), {f"{branch}/{name}": failing}, ready)
    assert (failed.name, failed.branch) == (name, branch)
    critical = [r.getMessage() for r in caplog.records if r.levelno == logging.CRITICAL]
    assert f"essential task {name} failed: RuntimeError: it broke" in critical


@pytest.mark.slow
async def test_an_api_that_cannot_bind_exits_non_zero_naming_it(tmp_path: Path) -> None:
    """A real failure in the api branch, as a user would meet it (the proxies' twin is in
    test_service.py). A subprocess: hypercorn leaves the socket it could not bind open,
    which would surface as a ResourceWarning in whichever test ran next."""
    with trio.socket.socket() as holder:
        await holder.bind(("127.0.0.1", 0))
        holder.listen()
        path = tmp_path / "c.toml"
        path.write_text(config_text(tmp_path, api=f"127.0.0.1:{holder.getsockname()[1]}"))
        async with daemon_process(path, wait_ready=False) as daemon:
            with trio.fail_after(20):
                await daemon.process.wait()
            await daemon.wait_for_line("vacancyd is exiting")
    assert daemon.process.returncode == 1
    assert "essential task api failed: OSError" in daemon.log


# -- shutdown order ---------------------------------------------------------------------


async def _held_upstream(finish: trio.Event, stream: trio.SocketStream) -> None:
    """Answer one request with half its body, the rest only once `finish` is set."""
    head = b""
    while b"\r\n\r\n" not in head:
        head += await stream.receive_some(4096)
    length = len(BODY_HEAD + BODY_TAIL)
    await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % length + BODY_HEAD)
    await finish.wait()
    await stream.send_all(BODY_TAIL)
    await stream.aclose()


async def _receive_until(stream: trio.SocketStream, wanted: bytes) -> bytes:
    """Read until `wanted` has arrived, or the connection ends; return all that came.

    An answer other than 200 ends the reading too, so a refusal fails the test rather
    than leaving it waiting on a kept-alive connection.
    """
    received = b""
    while wanted not in received:
        if b"\r\n\r\n" in received and not received.startswith(b"HTTP/1.1 200 "):
            break
        try:
            chunk = await stream.receive_some(4096)
        except trio.BrokenResourceError:
            break
        if not chunk:
            break
        received += chunk
    return received


class ShutdownWitness:
    """A component per branch that notes, in order, when its branch is cancelled."""

    def __init__(self) -> None:
        self.cancelled: list[str] = []

    def components(self, *branches: str) -> dict[str, Callable[..., Awaitable[None]]]:
        return {f"{branch}/witness:{branch}": partial(self._watch, branch) for branch in branches}

    async def _watch(self, branch: str, *, task_status: trio.TaskStatus[None]) -> None:
        task_status.started()
        try:
            await trio.sleep_forever()
        finally:
            self.cancelled.append(branch)


async def _shutdown_with_a_response_in_flight(
    tmp_path: Path, end_the_drain: Callable[[trio.Event], None], *, grace_s: float = 10.0
) -> tuple[bytes, list[str]]:
    """Start the daemon, hold one proxied response open and stop the daemon.

    Once everything has settled after the stop, a new connection must be refused and no
    witness cancelled; then `end_the_drain` is called with the event that lets the
    upstream finish its answer. Returns what the borrower got after that, and the order
    the witnesses were cancelled in.
    """
    finish = trio.Event()
    witness = ShutdownWitness()
    async with trio.open_nursery() as upstreams:
        bound = await upstreams.start(
            partial(trio.serve_tcp, partial(_held_upstream, finish), 0, host="127.0.0.1")
        )
        upstream_port = bound[0].socket.getsockname()[1]
        text = config_text(tmp_path, target=f"http://127.0.0.1:{upstream_port}", grace_s=grace_s)
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            running = await nursery.start(
                partial(
                    run_daemon,
                    parse_config(text),
                    extra_components=witness.components("collectors", "yield", "operations"),
                    handle_signals=False,
                    stop=stop,
                    environ={},
                )
            )
            proxy = urlsplit(InProcessDaemon(running, stop).proxy("llama"))
            assert proxy.hostname is not None and proxy.port is not None
            borrower = await trio.open_tcp_stream(proxy.hostname, proxy.port)
            await borrower.send_all(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            before = await _receive_until(borrower, BODY_HEAD)
            assert before.endswith(BODY_HEAD)

            stop.set()
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(OSError):
                await trio.open_tcp_stream(proxy.hostname, proxy.port)
            assert witness.cancelled == []  # the listener is draining; nothing else stops

            end_the_drain(finish)
            after = await _receive_until(borrower, BODY_TAIL)
            await borrower.aclose()
        upstreams.cancel_scope.cancel()
    return after, witness.cancelled


async def test_shutdown_lets_the_listeners_drain_before_reclaim_and_collectors_stop(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    """The borrower gets the whole answer, and only then is the rest of the tree closed."""

    after, cancelled = await _shutdown_with_a_response_in_flight(tmp_path, trio.Event.set)
    assert after == BODY_TAIL
    assert cancelled == ["yield", "collectors", "operations"]


async def test_a_drain_that_overruns_the_grace_is_cut_before_the_rest_stops(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    """Past `shutdown_grace_s` the in-flight response is cut; then the tree closes in order."""

    def let_the_grace_run_out(finish: trio.Event) -> None:
        mock_clock.jump(2.0)  # the upstream is never let finish

    after, cancelled = await _shutdown_with_a_response_in_flight(
        tmp_path, let_the_grace_run_out, grace_s=2.0
    )
    assert after == b""  # cut at the grace deadline, never completed
    assert cancelled == ["yield", "collectors", "operations"]
