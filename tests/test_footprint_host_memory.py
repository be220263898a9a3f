"""The server's host memory, read before and after an exclusive job (footprint/book.py).

The reading before a job is on the job's way to the upstream, so it does not look for
new children (psutil's search reads every process's stat file on the machine); the
reading after the job does, among the processes started since the last reading, and
what it finds is what the next reading before a job goes by. A real process tree: a
Python "server" that starts a child (which starts a grandchild) when told to.
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

# Says it runs; for each line it reads, starts a child that starts a grandchild, and
# prints both pids once both run.
SERVER = """
import subprocess, sys
GRANDCHILD = "import time; time.sleep(60)"
CHILD = (
    "import subprocess, sys, time; "
    f"g = subprocess.Popen([sys.executable, '-c', {GRANDCHILD!r}]); "
    "print(g.pid, flush=True); time.sleep(60)"
)
print(flush=True)
for _ in sys.stdin:
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    print(child.pid, child.stdout.readline().strip(), flush=True)
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


def start_children(server: subprocess.Popen[str]) -> list[int]:
    """A child of the server and a grandchild: their pids."""
    assert server.stdin is not None and server.stdout is not None
    server.stdin.write("\n")
    server.stdin.flush()
    return [int(pid) for pid in server.stdout.readline().split()]


async def test_the_reading_before_a_job_goes_by_the_tree_the_last_full_reading_found(
    tmp_path: Path,
) -> None:
    config = parse_config(lender_config("http://127.0.0.1:9", tmp_path, adapter="ollama"))
    (upstream,) = config.upstream
    children: list[int] = []  # the child and the grandchild, once started
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
            children += await trio.to_thread.run_sync(start_children, server)
            # A process of someone else's, started meanwhile, is never taken for the tree's.
            other = await trio.lowlevel.open_process(
                [sys.executable, "-c", "import time; time.sleep(60)"]
            )
            try:
                # Before a job: the tree as last found, without the new processes.
                assert await pids(look_for_children=False) == {server.pid}
                # After a job: those that joined the tree are found (among the processes
                # started since the last reading), and counted before a job from then on.
                assert await pids(look_for_children=True) == {server.pid, *children}
                assert await pids(look_for_children=False) == {server.pid, *children}
            finally:
                other.kill()
                await other.wait()
    finally:
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
