"""sd_notify over a real AF_UNIX datagram socket: addresses, message format, watchdog timing
from the environment, and a manager that is not there."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from tests.support.notify_socket import notify_socket
from vacancyd.notify import (
    Notifier,
    NotifyAddressError,
    message,
    parse_notify_address,
    watchdog_interval_s,
)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("/run/systemd/notify", "/run/systemd/notify"),
        ("@vacancyd/notify", b"\0vacancyd/notify"),
    ],
)
def test_notify_addresses_are_paths_or_abstract_names(value: str, expected: str | bytes) -> None:
    assert parse_notify_address(value) == expected


@pytest.mark.parametrize("value", ["vsock:2:1234", "relative/path", "@"])
def test_other_notify_addresses_are_refused_not_guessed(value: str) -> None:
    with pytest.raises(NotifyAddressError):
        parse_notify_address(value)


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, None),
        ({"WATCHDOG_USEC": "30000000"}, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}, 15.0),
        # Inherited by a child: not the process systemd watches.
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
        ({"WATCHDOG_USEC": "0"}, None),
    ],
)
def test_the_watchdog_interval_is_half_of_watchdog_usec(
    environ: dict[str, str], expected: float | None
) -> None:
    assert watchdog_interval_s(environ) == expected


def test_a_status_with_line_breaks_stays_one_assignment() -> None:
    assert message({"READY": "1", "STATUS": "not lending:\nowner_active"}) == (
        b"READY=1\nSTATUS=not lending: owner_active"
    )


@pytest.mark.parametrize("abstract", [False, True], ids=["path", "abstract"])
async def test_messages_arrive_as_datagrams(tmp_path: Path, abstract: bool) -> None:
    where: Path | str = (
        f"@vacancyd-test-{os.getpid()}-{id(tmp_path)}" if abstract else tmp_path / "n"
    )
    async with notify_socket(where) as systemd:
        notifier = Notifier.from_environ(systemd.environ())
        assert notifier is not None
        with notifier:
            assert await notifier.send(READY="1", STATUS="lending: llama")
            assert await notifier.send(WATCHDOG="1")
        first = await systemd.receive()
        second = await systemd.receive()
    assert first.fields == {"READY": "1", "STATUS": "lending: llama"}
    assert second.fields == {"WATCHDOG": "1"}


def test_no_notify_socket_means_no_notifier(caplog: pytest.LogCaptureFixture) -> None:
    assert Notifier.from_environ({}) is None
    with caplog.at_level(logging.WARNING, logger="vacancyd.notify"):
        assert Notifier.from_environ({"NOTIFY_SOCKET": "vsock:2:99"}) is None
    assert "unsupported NOTIFY_SOCKET" in caplog.text


async def test_a_manager_that_went_away_costs_one_log_line_not_the_daemon(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with (
        caplog.at_level(logging.WARNING, logger="vacancyd.notify"),
        Notifier(str(tmp_path / "gone")) as notifier,
    ):
        assert not await notifier.send(WATCHDOG="1")
        assert not await notifier.send(WATCHDOG="1")
    assert notifier.dropped == 2
    warnings = [r for r in caplog.records if "cannot notify" in r.getMessage()]
    assert len(warnings) == 1, caplog.text
    assert "ENOENT" in warnings[0].getMessage()
