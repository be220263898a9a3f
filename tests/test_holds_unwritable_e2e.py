"""A durable hold that cannot be written, end to end: the real daemon on a real disk.

tests/test_holds_unwritable.py shows the ledger's side. Here vacancyd runs as a
subprocess, as it does in production, because what matters is what the owner and an admin
see from outside (the /status `state_files` listing, the log at ERROR, the 503 `job_held`
a borrower gets) and that the hold outlives a restart. A daemon runs as root, and root
ignores permission bits, so a holds file is made unwritable in the two ways such a daemon
meets it:

* a directory where the file should be (every save fails with EISDIR), put there while the
  daemon runs, between its start and a cut;
* a full disk that can still be read: the daemon starts under a file-size limit
  (RLIMIT_FSIZE of 16 bytes, so every write fails with EFBIG; Python ignores SIGXFSZ) and
  the test lifts it with prlimit when "the disk recovers".

The hold is made by a real cut, as in tests/test_hold_restart.py: a generic OpenAI server
(which may keep working after its connection is cut) streams a borrowed answer, the owner
unlocks a session on a mock logind over a private dbus-daemon, and the cancel policy cuts
the stream.

Every daemon is given its runtime directory explicitly (`RUNTIME_DIRECTORY`, empty for
none, and an empty `XDG_RUNTIME_DIR` so the session's own is not used): a copy of the holds
goes there, and a copy left in a developer's real runtime directory would be restored by
(and leak into) other runs.

Real clock. Conditions are awaited on the daemon's own log lines or by polling /status
(or the disk) in loops bounded in count and by `trio.fail_after`; nothing sleeps a fixed
time and then assumes.
"""

from __future__ import annotations

import re
import resource
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager, suppress
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.support import status as polling
from tests.support.daemon import DaemonProcess, daemon_process
from tests.support.fake_http import raw_chunks
from tests.support.logind import MockLogind, mock_logind
from tests.support.upstreams import EchoUpstream

# The configs of tests/test_hold_restart.py: a cut on the owner's return makes a hold; two
# resources show what an untrusted (or unwritable) holds file refuses.
from tests.test_hold_restart import cut_on_return_config, status, two_resources_config
from vacancyd.admission import HOLDS_KIND
from vacancyd.admission.holds import COPY_NAME
from vacancyd.admission.ledger import RESAVE_MAX_S
from vacancyd.persist import read_json, write_json

# Each test starts (and most restart) the daemon as a subprocess.
pytestmark = pytest.mark.slow

SESSION = "2"
WAIT_S = 15.0
# The saver's pause grows to RESAVE_MAX_S: a recovered disk is written within one pause.
RECOVER_S = RESAVE_MAX_S + WAIT_S
POLL_S = 0.05
HOLD_REASON = "gen may keep running the job after its connection was cut"
RESTORED_REASON = f"{HOLD_REASON} (restored after restart)"
# Room for nothing: every state file vacancyd writes is larger.
TINY_FILE_LIMIT = 16
NO_RUNTIME_DIR = {"RUNTIME_DIRECTORY": "", "XDG_RUNTIME_DIR": ""}


# -- helpers --------------------------------------------------------------------------------


async def until(check: Callable[[], Any], what: str, timeout_s: float, log: str) -> Any:
    """Poll `check` (sync or async) until it returns something truthy; bounded in polls
    and in time, failing with `what` and the daemon's log."""
    polls = int(timeout_s / POLL_S) + 1
    last: Any = None
    with trio.move_on_after(timeout_s):
        for _ in range(polls):
            last = check()
            if hasattr(last, "__await__"):
                last = await last
            if last:
                return last
            await trio.sleep(POLL_S)
    raise AssertionError(f"never saw {what} within {timeout_s:g}s (last: {last!r}); log:\n{log}")


async def status_until(
    client: httpx.AsyncClient,
    daemon: DaemonProcess,
    predicate: Callable[[dict[str, Any]], bool],
    what: str,
    timeout_s: float = WAIT_S,
) -> dict[str, Any]:
    return await polling.status_until(
        partial(status, client, daemon),
        predicate,
        what,
        timeout_s=timeout_s,
        poll_s=POLL_S,
        log=lambda: daemon.log,
    )


def lending(document: dict[str, Any]) -> bool:
    return document["presence"]["refuses"] is None and document["resources"]["ram"]["quality"] == (
        "ready"
    )


def held_work(document: dict[str, Any], upstream: str = "gen") -> list[dict[str, Any]]:
    return [w for w in document["upstreams"][upstream]["active_work"] if w["phase"] == "held"]


async def work(
    client: httpx.AsyncClient, daemon: DaemonProcess, upstream: str = "gen"
) -> httpx.Response:
    return await client.post(
        f"{daemon.proxies[upstream]}/v1/chat/completions", json={"prompt": "x"}
    )


async def refused_held(
    client: httpx.AsyncClient, daemon: DaemonProcess, upstream: str = "gen"
) -> dict[str, Any]:
    """New borrowed work on `upstream` is refused as held; the error object."""
    refused = await work(client, daemon, upstream)
    assert refused.status_code == 503, refused.text
    error: dict[str, Any] = refused.json()["error"]
    assert (error["type"], error["code"]) == ("no_vacancy", "job_held"), error
    return error


async def admin_post(client: httpx.AsyncClient, daemon: DaemonProcess, path: str) -> httpx.Response:
    """An admin POST as the console and the CLI send it: JSON, the empty object."""
    return await client.post(f"{daemon.api}{path}", json={})


def at_error(pattern: str) -> str:
    """A pattern for the daemon's log line at ERROR (`<time> ERROR <logger>: <message>`)."""
    return r" ERROR \S+: .*" + pattern


def errors_naming(daemon: DaemonProcess, pattern: str) -> list[str]:
    regex = re.compile(at_error(pattern))
    return [line for line in daemon.lines if regex.search(line)]


@asynccontextmanager
async def locked_desk(
    tmp_path: Path, runtime: Path | None = None
) -> AsyncIterator[tuple[MockLogind, httpx.AsyncClient, dict[str, str]]]:
    """A locked local session on a mock logind (so borrowed work is lent), a client, and
    the environment a daemon needs: that bus, and `runtime` as its runtime directory, or
    none."""
    async with (
        mock_logind(tmp_path / "bus") as logind,
        httpx.AsyncClient(trust_env=False, timeout=WAIT_S) as client,
    ):
        await logind.add_session(SESSION, announce=False)
        await logind.set_locked(SESSION, True)
        where = (
            NO_RUNTIME_DIR
            if runtime is None
            else {"RUNTIME_DIRECTORY": str(runtime), "XDG_RUNTIME_DIR": ""}
        )
        yield logind, client, {"DBUS_SYSTEM_BUS_ADDRESS": logind.address, **where}


def break_file(path: Path) -> None:
    """A directory where the file goes: root's daemon cannot save it (EISDIR)."""
    path.unlink()
    path.mkdir()


def saved_holds(path: Path) -> list[dict[str, Any]]:
    payload = read_json(path, HOLDS_KIND)
    assert payload is not None, f"{path} is missing"
    holds: list[dict[str, Any]] = payload["holds"]
    return holds


async def cut_a_borrowed_stream(
    client: httpx.AsyncClient, daemon: DaemonProcess, logind: MockLogind
) -> int:
    """Borrow a stream, let the owner come back so that it is cut, and leave again: the
    generic server may still run the job, so vacancyd holds it. The held job's id."""
    await status_until(client, daemon, lending, "a locked session that lends")
    chat = f"{daemon.proxies['gen']}/v1/chat/completions"
    received = b""
    with pytest.raises(httpx.RemoteProtocolError):
        async with (
            client.stream("POST", chat, json={"echo_stream": {"events": 3}}) as stream,
            aclosing(raw_chunks(stream)) as pieces,
        ):
            assert stream.status_code == 200
            received += await pieces.__anext__()
            await logind.set_locked(SESSION, False)  # the owner is back
            async for piece in pieces:
                received += piece
    assert b"owner_active" in received
    held_line = await daemon.wait_for_line(r"holding ram for job \d+ on gen: ", WAIT_S)
    assert HOLD_REASON in held_line
    match = re.search(r"for job (\d+) on", held_line)
    assert match
    # The owner leaves again: lending resumes, but not on the held resource.
    await logind.set_locked(SESSION, True)
    await status_until(client, daemon, lending, "the session lending again")
    return int(match.group(1))


def lift_file_limit(pid: int) -> None:
    """The disk recovers: the daemon may write files of any size again."""
    unlimited = (resource.RLIM_INFINITY, resource.RLIM_INFINITY)
    with suppress(ProcessLookupError):
        resource.prlimit(pid, resource.RLIMIT_FSIZE, unlimited)


def tiny_file_limit() -> None:
    """In the daemon's child before exec: a disk that is full for every write."""
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (TINY_FILE_LIMIT, hard))


# -- 1. a cut job's hold while the file cannot be written -------------------------------------


async def test_a_hold_that_cannot_be_saved_is_reported_saved_once_it_can_and_restored(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    """The review's failure, end to end: the hold of a cut job whose file cannot be written
    must show where an operator looks (state_files, ERROR), keep refusing, reach the disk
    by itself once it recovers, and so still refuse after a restart until an admin acts.
    No runtime directory here, so the disk is the hold's only way across a restart."""
    state_dir = tmp_path / "state"
    holds = state_dir / "holds.json"
    config = tmp_path / "vacancyd.toml"
    config.write_text(cut_on_return_config(state_dir, echo.url))
    async with locked_desk(tmp_path) as (logind, client, env):
        async with daemon_process(config, env=env) as first:
            # Written at start, so the directory replaces a real file.
            assert saved_holds(holds) == []
            break_file(holds)
            job_id = await cut_a_borrowed_stream(client, first, logind)

            # Logged at ERROR with the path and why ...
            unsaved = at_error(f"cannot save durable holds to {re.escape(str(holds))}")
            error = await first.wait_for_line(unsaved, WAIT_S)
            assert "Is a directory" in error, error
            assert "no runtime directory to keep a copy in" in error
            # ... held as ever ...
            document = await status(client, first)
            [hold] = held_work(document)
            assert (hold["job_id"], hold["hold_reason"]) == (job_id, HOLD_REASON)
            refusal = await refused_held(client, first)
            assert refusal["message"] == f"ram is held: {HOLD_REASON}"
            # ... and listed as a state file in trouble, with the resource it holds.
            [problem] = document["state_files"]
            assert (problem["path"], problem["kind"]) == (str(holds), "holds")
            assert problem["reason"].startswith("cannot be written: "), problem
            assert "Is a directory" in problem["reason"]
            assert problem["resources"] == ["ram"]
            assert "a restart would go back to the holds last saved" in problem["consequence"]
            metrics = (await client.get(f"{first.api}/metrics")).text
            assert 'vacancyd_state_file_problems{kind="holds"} 1.0' in metrics

            # Tried again by itself while the disk still says no (the first retry is 1 s on).
            await until(
                lambda: len(errors_naming(first, "cannot save durable holds")) >= 2,
                "a second failed save",
                WAIT_S,
                first.log,
            )

            # The disk recovers: the next try writes the hold, and the problem is gone.
            holds.rmdir()
            await first.wait_for_line(
                rf"durable holds saved to {re.escape(str(holds))} again", RECOVER_S
            )
            [entry] = saved_holds(holds)
            assert (entry["job_id"], entry["resources"], entry["reason"]) == (
                job_id,
                ["ram"],
                HOLD_REASON,
            )
            document = await status_until(
                client, first, lambda d: d["state_files"] == [], "no state file problem"
            )
            assert [h["job_id"] for h in held_work(document)] == [job_id]
        assert first.process.returncode == 0, first.log

        # -- a restart on the same state directory: still held until released ---------------
        async with daemon_process(config, env=env) as second:
            await second.wait_for_line(r"1 durable hold\(s\) restored", WAIT_S)
            document = await status_until(client, second, lending, "the locked session lending")
            assert document["state_files"] == []
            [hold] = held_work(document)
            assert hold["hold_reason"] == RESTORED_REASON
            assert hold["held_since"] == entry["since"]
            refusal = await refused_held(client, second)
            assert refusal["message"] == f"ram is held: {RESTORED_REASON}"

            released = await admin_post(client, second, f"/admin/holds/{hold['job_id']}/release")
            assert released.status_code == 200, released.text
            assert released.json() == {"released": hold["job_id"], "resources": ["ram"]}
            admitted = await work(client, second)
            assert admitted.status_code == 200, admitted.text
            assert saved_holds(holds) == []
        assert second.process.returncode == 0, second.log


# -- 2. a holds file that cannot be written at start ----------------------------------------


async def test_a_holds_file_that_cannot_be_written_at_start_refuses_everything_until_cleared(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    """A run that cannot write the file at start cannot know whether the run before it
    left a hold unsaved, so it must refuse every resource, not only the one the file names;
    clearing that needs the disk back (the file must then take the holds), and afterwards
    only the hold the file named still refuses."""
    state_dir = tmp_path / "state"
    holds = state_dir / "holds.json"
    entry = {
        "job_id": 3,
        "upstream": "gen",
        "resources": ["ram"],
        "model": None,
        "job_ids": [],
        "reason": HOLD_REASON,
        "since": "2024-01-01T00:00:00+00:00",
    }
    write_json(holds, HOLDS_KIND, {"holds": [entry]})
    config = tmp_path / "vacancyd.toml"
    config.write_text(two_resources_config(state_dir, echo.url))

    async with (
        daemon_process(config, env=NO_RUNTIME_DIR, preexec_fn=tiny_file_limit) as daemon,
        httpx.AsyncClient(trust_env=False, timeout=WAIT_S) as client,
    ):
        try:
            unsaved = at_error(f"cannot save durable holds to {re.escape(str(holds))}")
            error = await daemon.wait_for_line(unsaved, WAIT_S)
            assert "File too large" in error, error
            document = await status(client, daemon)
            [problem] = document["state_files"]
            assert (problem["path"], problem["kind"]) == (str(holds), "holds")
            assert problem["reason"].startswith("cannot be written at start"), problem
            assert "File too large" in problem["reason"]
            assert sorted(problem["resources"]) == ["cpu", "ram"]
            # The hold the file names is restored, and every resource refuses.
            [hold] = held_work(document)
            assert hold["hold_reason"] == RESTORED_REASON
            for upstream, name in (("gen", "ram"), ("other", "cpu")):
                refusal = await refused_held(client, daemon, upstream)
                assert refusal["message"].startswith(f"{name} is held: "), refusal
                assert str(holds) not in refusal["message"]

            # The disk is still full: clearing cannot write the file, so nothing changes.
            stuck = await admin_post(client, daemon, "/admin/holds/unreadable/clear")
            assert stuck.status_code == 500, stuck.text
            assert stuck.json()["error"]["code"] == "cannot_clear"
            assert "File too large" in stuck.json()["error"]["message"]
            await refused_held(client, daemon, "other")
            assert [problem] == (await status(client, daemon))["state_files"]
            assert saved_holds(holds) == [entry]

            # The disk recovers; an admin clears: only the named hold still refuses.
            lift_file_limit(daemon.process.pid)
            cleared = await admin_post(client, daemon, "/admin/holds/unreadable/clear")
            assert cleared.status_code == 200, cleared.text
            assert cleared.json() == {
                "cleared": str(holds),
                "moved_to": None,
                "resources": ["cpu", "ram"],
            }
            admitted = await work(client, daemon, "other")
            assert admitted.status_code == 200, admitted.text
            refusal = await refused_held(client, daemon, "gen")
            assert refusal["message"] == f"ram is held: {RESTORED_REASON}"
            document = await status(client, daemon)
            assert document["state_files"] == []
            assert [h["hold_reason"] for h in held_work(document)] == [RESTORED_REASON]
            [saved] = saved_holds(holds)
            assert (saved["resources"], saved["reason"]) == (["ram"], HOLD_REASON)
        finally:
            # Before SIGTERM: coverage writes its data file as the daemon exits.
            lift_file_limit(daemon.process.pid)
    assert daemon.process.returncode == 0, daemon.log


# -- 3. the copy in the runtime directory ---------------------------------------------------


async def test_a_copy_in_the_runtime_directory_is_kept_until_the_file_is_saved(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    """Where systemd gives a runtime directory (a tmpfs apart from the state directory),
    the hold must be copied there while the disk refuses it, so a restart meanwhile finds
    it, and the copy must go once the file has it: a stale copy would be restored later."""
    state_dir = tmp_path / "state"
    holds = state_dir / "holds.json"
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    copy = runtime / COPY_NAME
    config = tmp_path / "vacancyd.toml"
    config.write_text(cut_on_return_config(state_dir, echo.url))
    async with locked_desk(tmp_path, runtime) as (logind, client, env):
        async with daemon_process(config, env=env) as daemon:
            break_file(holds)
            job_id = await cut_a_borrowed_stream(client, daemon, logind)
            error = await daemon.wait_for_line(at_error("cannot save durable holds"), WAIT_S)
            assert f"a copy is kept in {copy} for a restart" in error, error
            [entry] = saved_holds(copy)
            assert (entry["job_id"], entry["resources"], entry["reason"]) == (
                job_id,
                ["ram"],
                HOLD_REASON,
            )
            [problem] = (await status(client, daemon))["state_files"]
            assert str(copy) in problem["consequence"]

            holds.rmdir()
            await daemon.wait_for_line(r"durable holds saved to .* again", RECOVER_S)
            await until(lambda: not copy.exists(), f"{copy} removed", WAIT_S, daemon.log)
            assert [e["job_id"] for e in saved_holds(holds)] == [job_id]
            assert (await status(client, daemon))["state_files"] == []
        assert daemon.process.returncode == 0, daemon.log


async def test_a_restart_before_the_disk_recovers_keeps_the_copied_hold_through_a_clear(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    """The copy exists for a restart before the disk recovers. When the holds file is
    still not a file then, the run refuses everything (fail closed); but the copy is a
    hold vacancyd wrote itself, so clearing the bad file must not lend its resource: the
    cut job may still run. Clearing is the admin's word about the file, not about the job.
    """
    state_dir = tmp_path / "state"
    holds = state_dir / "holds.json"
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    copy = runtime / COPY_NAME
    config = tmp_path / "vacancyd.toml"
    config.write_text(cut_on_return_config(state_dir, echo.url))
    async with locked_desk(tmp_path, runtime) as (logind, client, env):
        async with daemon_process(config, env=env) as first:
            break_file(holds)
            job_id = await cut_a_borrowed_stream(client, first, logind)
            assert [e["job_id"] for e in saved_holds(copy)] == [job_id]
        assert first.process.returncode == 0, first.log
        assert holds.is_dir() and copy.exists()

        async with daemon_process(config, env=env) as second:
            document = await status_until(client, second, lending, "the locked session lending")
            [problem] = document["state_files"]
            assert problem["path"] == str(holds)
            assert "not a regular file" in problem["reason"], problem
            await refused_held(client, second)  # fail closed: this part holds

            cleared = await admin_post(client, second, "/admin/holds/unreadable/clear")
            assert cleared.status_code == 200, cleared.text
            # The copied hold must still hold ram, and be on disk now.
            refusal = await refused_held(client, second)
            assert refusal["message"].startswith(f"ram is held: {HOLD_REASON}"), refusal
            assert [e["reason"] for e in saved_holds(holds)] == [HOLD_REASON]
        assert second.process.returncode == 0, second.log


async def test_a_release_that_cannot_be_saved_says_so(echo: EchoUpstream, tmp_path: Path) -> None:
    """A release is in effect at once, but one the disk refused is undone by a restart
    (the file still names the hold). The admin must be told, as for an owner's switch that
    cannot be saved (500 `not_saved`), rather than read a plain 200 and walk away."""
    state_dir = tmp_path / "state"
    holds = state_dir / "holds.json"
    entry = {
        "job_id": 3,
        "upstream": "gen",
        "resources": ["ram"],
        "model": None,
        "job_ids": [],
        "reason": HOLD_REASON,
        "since": "2024-01-01T00:00:00+00:00",
    }
    write_json(holds, HOLDS_KIND, {"holds": [entry]})
    config = tmp_path / "vacancyd.toml"
    config.write_text(two_resources_config(state_dir, echo.url))
    async with (
        daemon_process(config, env=NO_RUNTIME_DIR) as daemon,
        httpx.AsyncClient(trust_env=False, timeout=WAIT_S) as client,
    ):
        [hold] = held_work(await status(client, daemon))
        break_file(holds)
        released = await admin_post(client, daemon, f"/admin/holds/{hold['job_id']}/release")
        # In effect now ...
        [problem] = (await status(client, daemon))["state_files"]
        assert problem["path"] == str(holds)
        assert held_work(await status(client, daemon)) == []
        # ... but the answer must say that a restart would bring the hold back.
        assert released.status_code == 500, released.text
        assert released.json()["error"]["code"] == "not_saved"
        holds.rmdir()
    assert daemon.process.returncode == 0, daemon.log
