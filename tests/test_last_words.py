"""A stuck daemon's stacks reach the journal as one ERROR entry (vacancyd/last_words.py).

The abort is real: a Python process arms the dump as `vacancyd run` does and sends itself
SIGABRT, as systemd's watchdog would. Under systemd ($RUNTIME_DIRECTORY) the stacks land
in a file, none on stderr, and the next start logs them as one record and removes it.
From a terminal they go to stderr, as faulthandler always wrote them.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from vacancyd import last_words

ABORT = (
    "import logging, os, signal; from vacancyd import last_words;"
    "print(last_words.arm(logging.getLogger('t')), flush=True);"
    "os.kill(os.getpid(), signal.SIGABRT)"
)


def aborted(environ: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "RUNTIME_DIRECTORY"} | environ
    done = subprocess.run(
        [sys.executable, "-c", ABORT],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == -signal.SIGABRT, done
    return done


def test_under_systemd_the_stacks_wait_in_the_runtime_directory_for_the_next_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    done = aborted({"RUNTIME_DIRECTORY": str(tmp_path)})
    path = tmp_path / last_words.FILE_NAME
    assert done.stdout.strip() == str(path)
    assert "Fatal Python error" not in done.stderr and "File " not in done.stderr
    assert "Current thread" in path.read_text() or "Thread 0x" in path.read_text()

    with caplog.at_level(logging.ERROR):
        last_words.report_previous(path, logging.getLogger("vacancyd"))
    [record] = caplog.records
    assert record.levelno == logging.ERROR
    message = record.getMessage()
    assert message.startswith("the last run was stopped by a fatal signal")
    assert 'File "<string>", line 1' in message  # where the aborting thread stood
    assert not path.exists()
    caplog.clear()
    last_words.report_previous(path, logging.getLogger("vacancyd"))  # nothing left
    assert caplog.records == []


def test_from_a_terminal_the_stacks_go_to_stderr() -> None:
    done = aborted({})
    assert done.stdout.strip() == "None"
    assert "Fatal Python error: Aborted" in done.stderr
    assert 'File "<string>", line 1' in done.stderr


def test_a_runtime_directory_it_cannot_write_leaves_them_on_stderr(tmp_path: Path) -> None:
    done = aborted({"RUNTIME_DIRECTORY": str(tmp_path / "missing")})
    assert done.stdout.strip() == "None"
    assert "Fatal Python error: Aborted" in done.stderr


def test_an_empty_file_from_a_clean_exit_is_removed_without_a_word(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / last_words.FILE_NAME
    path.write_text("")
    last_words.report_previous(path, logging.getLogger("vacancyd"))
    assert not path.exists() and caplog.records == []
