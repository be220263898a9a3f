"""Attribution: which processes serve an upstream, and whose GPU load is the owner's.

The scan is tested against real processes: a loopback listener started as a child
process, with a child of its own, found through the real psutil socket and process
tables. The arithmetic and the address rules are tested with plain values.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import attrs
import psutil
import pytest

from vacancyd.collect.attribution import (
    ListenSocket,
    ProcessIdentity,
    UnseenWork,
    UpstreamTree,
    attribute_gpu_load,
    current_start_times,
    listener_pids,
    not_attributable_reason,
    process_tree,
    scan_upstream_trees,
    upstreams_of,
)
from vacancyd.config.addresses import parse_target

# A stand-in inference server: listens on loopback and starts a worker, which starts a
# helper of its own (as Ollama starts runners that start their own children). It prints
# "<port> <worker pid> <helper pid>" and lives until its stdin closes.
_WORKER = textwrap.dedent(
    """
    import subprocess, sys, time
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(helper.pid, flush=True)
    time.sleep(600)
    """
)
_SERVER = textwrap.dedent(
    """
    import socket, subprocess, sys
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    worker = subprocess.Popen(
        [sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, text=True
    )
    helper = worker.stdout.readline().strip()
    print(listener.getsockname()[1], worker.pid, helper, flush=True)
    sys.stdin.read()
    """
)


@attrs.frozen
class Server:
    pid: int
    port: int
    worker_pid: int
    helper_pid: int


@pytest.fixture
def server() -> Iterator[Server]:
    process = subprocess.Popen(
        [sys.executable, "-c", _SERVER, _WORKER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert process.stdout is not None
        port_text, worker_text, helper_text = process.stdout.readline().split()
        yield Server(process.pid, int(port_text), int(worker_text), int(helper_text))
    finally:
        # The new session holds exactly the server, its worker and the worker's helper.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
        for stream in (process.stdin, process.stdout):
            if stream is not None:
                stream.close()


def _identity(pid: int) -> ProcessIdentity:
    return ProcessIdentity(pid, psutil.Process(pid).create_time())


def test_scan_finds_the_listener_and_its_descendants(server: Server) -> None:
    target = parse_target(f"http://127.0.0.1:{server.port}")
    trees = scan_upstream_trees({"llama": target})
    tree = trees["llama"]
    assert tree.attributable
    assert tree.processes == {
        _identity(server.pid),
        _identity(server.worker_pid),
        _identity(server.helper_pid),
    }
    assert tree.detail == f"3 process(es) serve 127.0.0.1:{server.port}"


def test_localhost_targets_are_attributable(server: Server) -> None:
    tree = scan_upstream_trees({"llama": parse_target(f"http://localhost:{server.port}/v1")})
    assert _identity(server.pid) in tree["llama"].processes


def test_a_target_on_another_host_is_never_matched_by_its_port(server: Server) -> None:
    # Same port as the real local listener: matching on the port alone would find it.
    for text in (f"http://192.0.2.10:{server.port}", f"http://gpu-box.lan:{server.port}"):
        tree = scan_upstream_trees({"remote": parse_target(text)})["remote"]
        assert not tree.attributable
        assert tree.processes == frozenset()
        assert "counts as owner load" in tree.detail


def test_nothing_listening_subtracts_nothing(server: Server) -> None:
    with_socket = psutil.net_connections(kind="tcp")
    used = {c.laddr.port for c in with_socket if c.laddr}
    free_port = next(p for p in range(40000, 65000) if p not in used)
    tree = scan_upstream_trees({"llama": parse_target(f"http://127.0.0.1:{free_port}")})["llama"]
    assert tree.attributable and tree.processes == frozenset()
    assert tree.detail.startswith("nothing listens on")


def test_upstream_gpu_use_is_subtracted_and_the_rest_is_the_owners(server: Server) -> None:
    trees = scan_upstream_trees({"llama": parse_target(f"http://127.0.0.1:{server.port}")})
    owner_pid = os.getpid()  # not in the tree: stands for the owner's game
    samples = [
        (server.pid, 40.0),
        (server.worker_pid, 10.0),
        (server.helper_pid, 5.0),
        (owner_pid, 25.0),
    ]
    start_times = current_start_times(pid for pid, _ in samples)
    result = attribute_gpu_load(samples, trees, start_times)
    assert result.owner_load_pct == 25.0
    assert result.subtracted_pct == 55.0
    assert result.upstreams_seen == {"llama"}


def test_a_reused_pid_is_not_subtracted(server: Server) -> None:
    """A tree member whose pid now belongs to a process with another start time."""
    trees = scan_upstream_trees({"llama": parse_target(f"http://127.0.0.1:{server.port}")})
    samples = [(server.worker_pid, 60.0)]
    start_times = current_start_times([server.worker_pid])
    assert attribute_gpu_load(samples, trees, start_times).owner_load_pct == 0.0
    reborn = {server.worker_pid: start_times[server.worker_pid] + 30.0}
    result = attribute_gpu_load(samples, trees, reborn)
    assert result.owner_load_pct == 60.0
    assert result.upstreams_seen == frozenset()


def test_an_exited_process_counts_as_the_owners() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    tree = UpstreamTree("llama", True, process_tree(child.pid))
    assert tree.processes == {_identity(child.pid)}
    child.kill()
    child.wait(timeout=10)  # reaped: its pid no longer names it
    start_times = current_start_times([child.pid])
    assert child.pid not in start_times
    result = attribute_gpu_load([(child.pid, 30.0)], [tree], start_times)
    assert result.owner_load_pct == 30.0 and result.upstreams_seen == frozenset()


def test_process_tree_of_a_missing_pid_is_empty() -> None:
    # Linux never hands out pids above 2**22 (the largest pid_max).
    assert process_tree(2**22 + 12345) == frozenset()


def test_owner_load_is_capped_at_one_hundred() -> None:
    result = attribute_gpu_load([(1, 80.0), (2, 70.0)], {}, {1: 1.0, 2: 2.0})
    assert result.owner_load_pct == 100.0


def test_a_non_finite_utilisation_makes_owner_load_non_finite() -> None:
    result = attribute_gpu_load([(1, float("nan"))], {}, {1: 1.0})
    assert result.owner_load_pct != result.owner_load_pct


def test_trees_may_be_given_as_a_list() -> None:
    tree = UpstreamTree("a", True, frozenset({ProcessIdentity(7, 100.0)}))
    result = attribute_gpu_load([(7, 20.0)], [tree], {7: 100.4})
    assert result.subtracted_pct == 20.0 and result.upstreams_seen == {"a"}


def test_upstreams_of_names_the_trees_that_hold_these_processes(server: Server) -> None:
    trees = scan_upstream_trees({"llama": parse_target(f"http://127.0.0.1:{server.port}")})
    start_times = current_start_times([server.helper_pid, os.getpid()])
    assert upstreams_of([server.helper_pid], trees, start_times) == {"llama"}
    assert upstreams_of([os.getpid()], trees, start_times) == frozenset()
    stale = {server.helper_pid: start_times[server.helper_pid] - 60.0}
    assert upstreams_of([server.helper_pid], trees, stale) == frozenset()


# -- the address rules ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("target", "attributable"),
    [
        ("http://127.0.0.1:8080", True),
        ("http://127.0.0.2:8080", True),
        ("http://[::1]:8080", True),
        ("http://localhost:8080", True),
        ("http://LOCALHOST:8080", True),
        ("http://10.0.0.5:8080", False),
        ("http://[fe80::1]:8080", False),
        ("http://ip6-localhost:8080", False),
        ("http://myhost:8080", False),
        ("http://0.0.0.0:8080", False),
    ],
)
def test_only_loopback_targets_are_attributable(target: str, attributable: bool) -> None:
    assert (not_attributable_reason(parse_target(target)) is None) is attributable


def _pids(sockets: list[ListenSocket], target: str) -> tuple[set[int], int]:
    return listener_pids(sockets, parse_target(target))


def test_an_exact_listener_wins_over_a_wildcard() -> None:
    sockets = [
        ListenSocket("0.0.0.0", 8080, 10),
        ListenSocket("127.0.0.1", 8080, 11),
        ListenSocket("127.0.0.1", 9090, 12),
    ]
    assert _pids(sockets, "http://127.0.0.1:8080") == ({11}, 0)
    assert _pids(sockets[:1], "http://127.0.0.1:8080") == ({10}, 0)
    assert _pids(sockets, "http://127.0.0.1:7070") == (set(), 0)


def test_wildcards_serve_only_the_families_they_accept() -> None:
    v4_any = [ListenSocket("0.0.0.0", 8080, 10)]
    v6_any = [ListenSocket("::", 8080, 20)]
    assert _pids(v4_any, "http://[::1]:8080") == (set(), 0)
    assert _pids(v6_any, "http://[::1]:8080") == ({20}, 0)
    assert _pids(v6_any, "http://127.0.0.1:8080") == ({20}, 0)  # dual-stack by default
    assert _pids(v4_any + v6_any, "http://localhost:8080") == ({10, 20}, 0)


def test_localhost_matches_any_loopback_listener() -> None:
    sockets = [ListenSocket("::1", 8080, 30), ListenSocket("127.0.0.1", 8080, 31)]
    assert _pids(sockets, "http://localhost:8080") == ({30, 31}, 0)
    assert _pids(sockets, "http://127.0.0.1:8080") == ({31}, 0)


def test_ipv4_mapped_listeners_and_hidden_owners() -> None:
    sockets = [ListenSocket("::ffff:127.0.0.1", 8080, None), ListenSocket("junk", 8080, 5)]
    assert _pids(sockets, "http://127.0.0.1:8080") == (set(), 1)


def test_the_tree_says_when_the_listener_is_another_users() -> None:
    target = parse_target("http://127.0.0.1:8080")
    trees = scan_upstream_trees({"llama": target}, [ListenSocket("127.0.0.1", 8080, None)])
    assert trees["llama"].processes == frozenset()
    assert "belongs to another user" in trees["llama"].detail


# -- unseen GPU work -----------------------------------------------------------------------


def test_unseen_work_is_reported_after_three_busy_rounds(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tracker = UnseenWork()
    with caplog.at_level(logging.INFO, logger="vacancyd.collect.attribution"):
        assert tracker.observe({"relay"}, set()) == frozenset()
        assert tracker.observe({"relay"}, set()) == frozenset()
        assert tracker.observe({"relay"}, set()) == {"relay"}
        assert tracker.observe({"relay"}, set()) == {"relay"}
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "relay" in warnings[0].getMessage() and "unseen_gpu_work" in warnings[0].getMessage()
    assert tracker.is_unseen("relay")


def test_unseen_work_needs_consecutive_busy_rounds() -> None:
    tracker = UnseenWork()
    tracker.observe({"a"}, set())
    tracker.observe({"a"}, set())
    tracker.observe(set(), set())  # no work running: the run of rounds is broken
    tracker.observe({"a"}, set())
    tracker.observe({"a"}, set())
    assert tracker.unseen == frozenset()
    tracker.observe({"a"}, set())
    assert tracker.unseen == {"a"}


def test_unseen_work_clears_as_soon_as_the_tree_is_seen() -> None:
    tracker = UnseenWork()
    for _ in range(3):
        tracker.observe({"a", "b"}, {"b"})
    assert tracker.unseen == {"a"}
    tracker.observe(set(), set())
    assert tracker.unseen == {"a"}  # idle rounds do not clear the report
    assert tracker.observe({"a"}, {"a"}) == frozenset()
    tracker.observe({"a"}, set())
    tracker.observe({"a"}, set())
    assert tracker.unseen == frozenset()  # the count starts again from nothing
