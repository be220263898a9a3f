"""One archive an owner can attach to a bug report, and nothing in it they must not share.

The daemon assembles a diagnostics document (GET /admin/diagnostics): /status, the
effective configuration, software versions, the recent decision log, collector notes and
liveness, and the last log lines from the in-memory ring. `vacancyd diagnostics -o FILE`
writes it as a tar.gz, one file per part, so a maintainer can read each with any tool.

What is left out on purpose:

* Secrets: token digests and anything else whose key names a secret are replaced by
  REDACTED; userinfo in URLs too. File paths stay (they say where a permission problem
  is); the files' contents are never read.
* Borrowers' prompts: no request or response body, header or query string is kept
  anywhere in the daemon. The decision log keeps what the gate was asked (upstream,
  model name, memory needs), and the log ring listens only to vacancyd's own loggers,
  which log methods, paths and upstream names, never bodies (httpx, which logs whole
  URLs at debug, is not in the ring).
"""

from __future__ import annotations

import io
import json
import os
import platform
import re
import sys
import tarfile
import tempfile
import time
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

import cattrs

import vacancyd
from vacancyd.config import Config, LendingWindow

REDACTED = "<redacted>"
# Keys whose string values are secrets. Paths of files that hold secrets are not.
_SECRET_KEY = re.compile(r"sha256|digest|secret|password|passwd|token|api_key|credential")
_PATH_KEY = re.compile(r"(^|_)(file|path|dir)$")
_URL_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s]*@")

PACKAGES = (
    "trio",
    "hypercorn",
    "quart",
    "quart-trio",
    "httpx",
    "attrs",
    "cattrs",
    "psutil",
    "nvidia-ml-py",
    "jeepney",
    "trio-websocket",
    "prometheus-client",
)

_plain = cattrs.Converter()
# The config as the owner wrote it: `from` is a Python keyword, the field is `from_`.
_plain.register_unstructure_hook(
    LendingWindow, lambda w: {"from": w.from_, "to": w.to, "days": list(w.days)}
)


def redact(value: Any, key: str = "") -> Any:
    """`value` with every secret replaced by REDACTED, recursively."""
    if isinstance(value, Mapping):
        return {k: redact(v, str(k)) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact(item, key) for item in value]
    if isinstance(value, str):
        if _SECRET_KEY.search(key.lower()) and not _PATH_KEY.search(key.lower()):
            return REDACTED
        return _URL_USERINFO.sub(rf"\g<scheme>{REDACTED}@", value)
    return value


def redacted_config(config: Config) -> dict[str, Any]:
    """The effective configuration, defaults included, as JSON values, secrets redacted."""
    unstructured: dict[str, Any] = _plain.unstructure(config)
    result: dict[str, Any] = redact(unstructured)
    return result


def software_versions() -> dict[str, Any]:
    """vacancyd, Python, the platform and the libraries that shape its behaviour."""
    packages: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            packages[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            packages[name] = None
    return {
        "vacancyd": vacancyd.__version__,
        "python": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "packages": packages,
    }


README = """vacancyd diagnostics, generated {generated_at}

status.json       what /status said
config.json       the effective configuration (defaults included); secrets are {redacted}
versions.json     vacancyd, Python, libraries, the NVIDIA driver and logind (if known)
decisions.json    the most recent admission decisions and the inputs the gate saw
collectors.json   collector notes, the NVML view and each essential task's liveness
log.txt           the last log lines of vacancyd's own loggers, one line per event

No request or response body, header or query string is included.
"""

PARTS = ("status", "config", "versions", "decisions", "collectors")


def archive_bytes(document: Mapping[str, Any]) -> bytes:
    """The diagnostics document as a tar.gz: README.txt, one JSON file per part, log.txt."""
    generated_at = str(document.get("generated_at", "unknown time"))
    stamp = re.sub(r"[^0-9A-Za-z]", "", generated_at)[:15] or "now"
    top = f"vacancyd-diagnostics-{stamp}"
    files = {"README.txt": README.format(generated_at=generated_at, redacted=REDACTED)}
    for part in PARTS:
        files[f"{part}.json"] = json.dumps(document.get(part), indent=2, sort_keys=True) + "\n"
    files["log.txt"] = "".join(f"{line}\n" for line in document.get("log", []))
    buffer = io.BytesIO()
    mtime = int(time.time())
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size = len(data)
            info.mtime = mtime
            info.mode = 0o600
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def write_private(path: Path, data: bytes) -> None:
    """Write `data` to `path` (0600) through a temporary sibling, so no half file is left."""
    directory = path.parent
    fd, temp = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
