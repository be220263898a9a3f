"""The owner comes back while a REAL llama-server works for a borrower.

vacancyd runs as a subprocess in front of the session's llama-server (the `llama_url`
fixture), with presence from logind: a mock logind on a private system bus
(tests/support/logind.py) holds one graphical session, locked when the test starts. The
owner policy lends while the session is locked (`lend_when_locked = true`) and treats an
unlocked one as the owner at work; the owner "returns" by the real SetLockedHint(false)
call a screen locker makes, and vacancyd hears it through its own bus connection.

* drain (drain_timeout_s = 2): a long streamed completion keeps streaming after the
  unlock and is cut at the drain deadline: the client sees the stream break (no [DONE],
  a transport error), and new work is refused owner_active at once.
* cancel: a non-streamed completion has no answer until llama-server has generated every
  token, so cutting it while the server is generating is a cut before the answer: the
  borrower gets a clean 503 owner_active, and llama-server, seeing its client gone, stops.

Requests ask for `ignore_eos` so the tiny model cannot end its answer early. Assertions
are about statuses, stream shape and timing bounds, never the model's words. Real clock
across processes: events (the daemon's log lines) where it writes one, otherwise bounded
polling; nothing sleeps for a fixed time and then assumes.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from tests.support.configs import daemon_config, upstream
from tests.support.daemon import DaemonProcess, daemon_process
from tests.support.fake_http import raw_chunks
from tests.support.logind import MockLogind, mock_logind

pytestmark = pytest.mark.e2e

SESSION = "2"
DRAIN_S = 2.0
WAIT_S = 20.0
POLL_S = 0.05
LLAMA_POLL_S = 1.5  # see Desk.until_llama_idle
# Far more tokens than can be generated within the drain (about 40 per second for this
# model on one thread), and well within a slot's 1024-token context.
LONG = {"prompt": "Once upon a time", "max_tokens": 800, "ignore_eos": True, "temperature": 0}


def config(state_dir: Path, target: str, policy: str) -> str:
    return daemon_config(
        upstream(
            "llama",
            target,
            adapter="llamacpp",
            on_owner_return=policy,
            drain_timeout_s=DRAIN_S,
            default_need_mib={"ram": 512},
        ),
        state_dir=state_dir,
        poll_interval_s=1.0,
        presence="logind",
        owner={"lend_when_locked": True, "lend_when_idle": False, "release_after_s": 3600},
    )


@attrs.frozen
class Desk:
    logind: MockLogind
    daemon: DaemonProcess
    client: httpx.AsyncClient
    llama_url: str

    @property
    def completions(self) -> str:
        return f"{self.daemon.proxies['llama']}/v1/completions"

    async def status(self) -> dict[str, Any]:
        response = await self.client.get(f"{self.daemon.api}/status")
        assert response.status_code == 200, response.text
        document: dict[str, Any] = response.json()
        return document

    async def until(
        self, probe: Callable[[], Awaitable[bool]], what: str, every_s: float = POLL_S
    ) -> None:
        """Poll `probe` until it holds; bounded in polls and in time."""
        with trio.move_on_after(WAIT_S):
            for _ in range(int(WAIT_S / every_s) + 1):
                if await probe():
                    return
                await trio.sleep(every_s)
        raise AssertionError(f"never saw {what} within {WAIT_S:g}s; log:\n{self.daemon.log}")

    async def lending(self) -> bool:
        document = await self.status()
        return document["presence"]["refuses"] is None and (
            document["resources"]["ram"]["quality"] == "ready"
        )

    async def no_work(self) -> bool:
        document = await self.status()
        return not document["upstreams"]["llama"]["active_work"]

    async def llama_generating(self) -> bool:
        """Whether a slot of the llama-server is working (read from it directly)."""
        slots = (await self.client.get(f"{self.llama_url}/slots")).json()
        return any(slot["is_processing"] for slot in slots)

    async def until_llama_idle(self, what: str) -> None:
        """Wait for llama-server to stop generating, asking it only every LLAMA_POLL_S.

        llama-server notices a departed client of a non-streamed request only when a wait
        for that request's results times out (after a second), and every answer to any
        other request, /slots included, restarts that wait: polled faster, it would never
        notice, and would generate to the end.
        """

        async def idle() -> bool:
            return not await self.llama_generating()

        await self.until(idle, what, every_s=LLAMA_POLL_S)

    async def owner_returns(self) -> float:
        """Unlock the session; returns the time just before the call."""
        before = trio.current_time()
        await self.logind.set_locked(SESSION, False)
        return before


@asynccontextmanager
async def owners_desk(tmp_path: Path, llama_url: str, policy: str) -> AsyncIterator[Desk]:
    """A locked graphical session, then vacancyd lending llama-server while it stays locked."""
    config_path = tmp_path / "vacancyd.toml"
    config_path.write_text(config(tmp_path / "state", llama_url, policy))
    async with mock_logind(tmp_path / "bus") as logind:
        await logind.add_session(SESSION, announce=False)
        await logind.set_locked(SESSION, True)
        async with (
            httpx.AsyncClient(trust_env=False, timeout=60) as client,
            daemon_process(config_path, env={"DBUS_SYSTEM_BUS_ADDRESS": logind.address}) as daemon,
        ):
            desk = Desk(logind, daemon, client, llama_url)
            # Whatever an earlier test left running on the shared server has stopped.
            await desk.until_llama_idle("llama-server idle")
            await desk.until(desk.lending, "a locked session that lends")
            yield desk


def sse_events(received: bytes) -> list[bytes]:
    return [
        block.removeprefix(b"data: ")
        for block in received.split(b"\n\n")
        if block.startswith(b"data: ")
    ]


async def test_a_long_stream_is_cut_at_the_drain_deadline_after_the_owner_unlocks(
    tmp_path: Path, llama_url: str
) -> None:
    async with owners_desk(tmp_path, llama_url, "drain") as desk:
        received = b""
        returned = 0.0
        with pytest.raises(httpx.RemoteProtocolError):
            async with (
                desk.client.stream("POST", desk.completions, json={**LONG, "stream": True}) as s,
                aclosing(raw_chunks(s)) as pieces,
            ):
                assert s.status_code == 200
                assert s.headers["content-type"].startswith("text/event-stream")
                received += await pieces.__anext__()
                returned = await desk.owner_returns()
                await desk.daemon.wait_for_line(r"reclaiming llama \(owner, drain\)", WAIT_S)
                # New work is refused at once; the admitted stream goes on draining.
                refused = await desk.client.post(desk.completions, json={"prompt": "hi"})
                assert refused.status_code == 503, refused.text
                assert refused.headers["retry-after"] == "120"
                assert refused.json()["error"]["code"] == "owner_active"
                async for piece in pieces:
                    received += piece
        cut_after = trio.current_time() - returned

        events = sse_events(received)
        assert b"[DONE]" not in events, "the stream ended cleanly"
        chunks = [json.loads(event) for event in events if event.startswith(b"{")]
        # The last event is vacancyd's, naming why the stream ends; the connection then breaks.
        *chunks, final = chunks
        assert final["error"]["code"] == "owner_active", final
        assert len(chunks) >= 2, "the stream did not keep going during the drain"
        assert all(chunk["choices"][0]["finish_reason"] is None for chunk in chunks)
        # Cut no earlier than the drain deadline after the edge (which follows the unlock),
        # and not long after it.
        assert DRAIN_S <= cut_after < DRAIN_S + 8.0, f"cut {cut_after:.2f}s after the unlock"

        # The job ends with its connection (llama-server stops on a cut: nothing is held).
        await desk.until(desk.no_work, "the cut job released")
        document = await desk.status()
        reclaim = document["upstreams"]["llama"]["reclaim"]["last"]
        assert (reclaim["trigger"], reclaim["policy"], reclaim["phase"]) == (
            "owner",
            "drain",
            "done",
        )
        assert len(reclaim["cancelled_jobs"]) == 1
        assert document["presence"]["session"] == "active"
        await desk.until_llama_idle("llama-server stop generating for the cut stream")


async def test_cancel_before_the_answer_gives_the_borrower_a_clean_503(
    tmp_path: Path, llama_url: str
) -> None:
    async with owners_desk(tmp_path, llama_url, "cancel") as desk:
        answers: list[httpx.Response] = []
        async with trio.open_nursery() as nursery:

            async def borrower() -> None:
                answers.append(await desk.client.post(desk.completions, json=LONG))

            nursery.start_soon(borrower)
            # Admitted, and llama-server is generating: nothing of the answer exists yet.
            await desk.until(desk.llama_generating, "llama-server generating")
            [job] = (await desk.status())["upstreams"]["llama"]["active_work"]
            assert job["phase"] == "forwarding"
            await desk.owner_returns()
        [answer] = answers
        assert answer.status_code == 503, answer.text
        assert answer.headers["retry-after"] == "120"
        error = answer.json()["error"]
        assert (error["type"], error["code"]) == ("no_vacancy", "owner_active")
        assert error["message"].startswith("the owner is back: ")

        # Released just after the answer was sent: wait for it rather than race it.
        await desk.until(desk.no_work, "the cut job released")
        document = await desk.status()
        reclaim = document["upstreams"]["llama"]["reclaim"]["last"]
        assert (reclaim["policy"], reclaim["cancelled_jobs"]) == ("cancel", [job["job_id"]])
        # The proxy closed its connection to llama-server, which stopped generating.
        await desk.until_llama_idle("llama-server stop generating for the cut request")
