"""The commands that talk to a running daemon over its API: `status`, `pause`, `resume`,
`holds`, `release`, `debug` and `diagnostics`.

Each finds the API from the config (or `--api`), presents the token its scope needs, makes
one call and prints the answer for a person (status_text.py) or as JSON. A failure is one
line on stderr and an exit code: the daemon cannot be reached, no credential, or the
daemon's own refusal with its message. The command line itself is cli.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import httpx

from vacancyd.config import Config, Scope, load_config, parse_listen
from vacancyd.errors import ConfigError
from vacancyd.status_text import holds_of, local_time, render_holds, render_status

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_CONFIG = 2


def print_problems(source: str, exc: ConfigError) -> None:
    """A config's problems as every command reports them: the count, then one per line."""
    print(f"{source}: {len(exc.messages)} problem(s):", file=sys.stderr)
    for message in exc.messages:
        print(f"  {message}", file=sys.stderr)


def _api_target(args: argparse.Namespace, scope: Scope) -> tuple[str, str | None] | int:
    """The API base URL and a token for it, or an exit code after printing why not."""
    from vacancyd.auth import token_for_cli

    if args.api:
        return args.api.rstrip("/"), args.token or os.environ.get("VACANCYD_TOKEN")
    try:
        config: Config = load_config(args.config)
    except ConfigError as exc:
        print_problems(args.config or "<embedded default>", exc)
        return EXIT_CONFIG
    listen = parse_listen(config.server.api_listen)
    host = listen.host
    if host in ("0.0.0.0", "::"):
        host = "127.0.0.1" if host == "0.0.0.0" else "::1"
    base = f"http://[{host}]:{listen.port}" if ":" in host else f"http://{host}:{listen.port}"
    return base, args.token or token_for_cli(config.auth, scope)


def _call(method: str, url: str, token: str | None, body: Any = None) -> httpx.Response | int:
    """One request to the API. Anything but a read goes as JSON, `{}` when there is
    nothing to say: the API refuses other bodies on requests that change something, so
    that another site's page in the owner's browser cannot forge one."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if body is None and method not in ("GET", "HEAD"):
        body = {}
    try:
        with httpx.Client(trust_env=False, timeout=10.0) as client:
            return client.request(method, url, headers=headers, json=body)
    except httpx.HTTPError as exc:
        print(f"vacancyd: cannot reach {url}: {exc}", file=sys.stderr)
        return EXIT_FAILED


def _explain_failure(response: httpx.Response) -> int:
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text.strip()
    print(f"vacancyd: the daemon answered {response.status_code}: {message}", file=sys.stderr)
    return EXIT_FAILED


def _ask(
    args: argparse.Namespace, scope: Scope, method: str, path: str, body: Any = None
) -> dict[str, Any] | int:
    """One call to the daemon's API: its JSON answer, or the exit code of a failure (said
    on stderr: no daemon, no credential, or the daemon's own refusal)."""
    target = _api_target(args, scope)
    if isinstance(target, int):
        return target
    base, token = target
    response = _call(method, f"{base}{path}", token, body)
    if isinstance(response, int):
        return response
    if response.status_code != 200:
        return _explain_failure(response)
    answer: dict[str, Any] = response.json()
    return answer


def _fetch_status(args: argparse.Namespace) -> dict[str, Any] | int:
    """The daemon's /status document (read scope), or the exit code of a failure."""
    return _ask(args, Scope.READ, "GET", "/status")


def status(args: argparse.Namespace) -> int:
    document = _fetch_status(args)
    if isinstance(document, int):
        return document
    if args.json:
        print(json.dumps(document, indent=2))
    else:
        print(render_status(document))
    return EXIT_OK


def _set_lending(
    args: argparse.Namespace, enabled: bool, for_s: float | None = None, now: bool = False
) -> int:
    body: dict[str, Any] = {"enabled": enabled}
    if for_s is not None:
        body["for_s"] = for_s
    if now:
        body["now"] = True
    answer = _ask(args, Scope.ADMIN, "POST", "/admin/lending", body)
    if isinstance(answer, int):
        return answer
    given_back = "; running borrowed work is being reclaimed now" if now else ""
    if enabled:
        print("lending resumed")
    elif answer["lending"].get("paused_until"):
        until = local_time(answer["lending"]["paused_until"])
        print(f"lending paused until {until}: new borrowed work is refused until then{given_back}")
    else:
        print(f"lending paused: new borrowed work is refused until you resume{given_back}")
    return EXIT_OK


def pause(args: argparse.Namespace) -> int:
    return _set_lending(args, False, args.for_s, args.now)


def resume(args: argparse.Namespace) -> int:
    return _set_lending(args, True)


def holds(args: argparse.Namespace) -> int:
    """List holds from /status, so the read scope is enough to see why nothing is lent."""
    document = _fetch_status(args)
    if isinstance(document, int):
        return document
    holds = holds_of(document)
    print(json.dumps(holds, indent=2) if args.json else render_holds(holds))
    return EXIT_OK


def release(args: argparse.Namespace) -> int:
    """End one hold, or clear an untrusted holds file: an admin's word, nothing else."""
    path = (
        "/admin/holds/unreadable/clear"
        if args.unreadable_file
        else f"/admin/holds/{args.job_id}/release"
    )
    answer = _ask(args, Scope.ADMIN, "POST", path)
    if isinstance(answer, int):
        return answer
    if args.unreadable_file:
        moved = answer["moved_to"]
        kept = f"kept as {moved}" if moved else "nothing was moved aside"
        print(f"cleared the holds file {answer['cleared']}; {kept}")
    else:
        print(f"released job {answer['released']}: {', '.join(answer['resources'])}")
    return EXIT_OK


def debug(args: argparse.Namespace) -> int:
    """Open a debug logging window on the daemon (or close it with --off)."""
    from vacancyd.durations import describe_duration

    seconds = 0.0 if args.off else args.for_s
    answer = _ask(args, Scope.ADMIN, "POST", "/admin/debug", {"for_s": seconds})
    if isinstance(answer, int):
        return answer
    window = answer["debug_logging"]
    if window["active"]:
        ends = describe_duration(window["ends_in_s"])
        print(f"debug logging on for {ends}; it turns itself off then")
    else:
        print("debug logging off")
    return EXIT_OK


def diagnostics(args: argparse.Namespace) -> int:
    """Fetch the diagnostics document and write it as one private tar.gz archive."""
    from datetime import UTC, datetime

    from vacancyd.diagnostics import archive_bytes, write_private

    document = _ask(args, Scope.ADMIN, "GET", "/admin/diagnostics")
    if isinstance(document, int):
        return document
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    path = Path(args.output or f"vacancyd-diagnostics-{stamp}.tar.gz")
    data = archive_bytes(document)
    try:
        write_private(path, data)
    except OSError as exc:
        print(f"vacancyd: cannot write {path}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_FAILED
    print(
        f"wrote {path} ({len(data)} bytes, {len(document.get('log', []))} log lines); "
        "secrets are redacted and no borrower's request is in it"
    )
    return EXIT_OK
