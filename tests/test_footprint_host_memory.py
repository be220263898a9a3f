"""The server's host memory, read before and after an exclusive job (footprint/book.py).

The reading before a job is on the job's way to the upstream, so it does not look for
new children (that reads every process's stat file on the machine); the reading after
the job does, and what it finds is what the next reading before a job goes by. A real
process tree: a Python "server" that starts a child when told to.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import trio

from tests.support.clients import lender_config
from vacancyd.config import parse_config
from vacancyd.footprint.book import FootprintBook
from vacancyd.persist import StateFileProblems

# Prints its pid; for each line it reads, starts a child that sleeps and prints its pid.
SERVER = """
import subprocess, sys
print(flush=True)
for _ in sys.stdin:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    print(child.pid, flush=True)
"""


@contextmanager
def server_tree() -> Iterator[subprocess.Popen[str]]:
    with subprocess.Popen(
        [sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as process:
        try:
            assert process.stdout is not None
            process.stdout.readline()  # running
            yield process
        finally:
            process.kill()


def start_child(server: subprocess.Popen[str]) -> int:
    assert server.stdin is not None and server.stdout is not None
    server.stdin.write("\n")
    server.stdin.flush()
    return int(server.stdout.readline())


async def test_the_reading_before_a_job_goes_by_the_tree_the_last_full_reading_found(
    tmp_path: Path,
) -> None:
    config = parse_config(lender_config("http://127.0.0.1:9", tmp_path, adapter="ollama"))
    (upstream,) = config.upstream
    children: list[int] = []
    try:
        with server_tree() as server:
            book = FootprintBook(
                tmp_path,
                StateFileProblems(),
                resources=config.resource,
                find_server=lambda target: {server.pid},
            )

            async def pids(*, look_for_children: bool) -> set[int]:
                tree = await book.host_memory(upstream, look_for_children=look_for_children)
                assert tree is not None and tree.rss_bytes > 0
                return {member.pid for member in tree.members}

            # Never read in full: the first reading is a full one, whatever it is asked.
            assert await pids(look_for_children=False) == {server.pid}
            children.append(await trio.to_thread.run_sync(start_child, server))
            # Before a job: the tree as last found, without the new child.
            assert await pids(look_for_children=False) == {server.pid}
            # After a job: the child is found, and from then on counted before a job too.
            assert await pids(look_for_children=True) == {server.pid, children[0]}
            assert await pids(look_for_children=False) == {server.pid, children[0]}
    finally:
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
