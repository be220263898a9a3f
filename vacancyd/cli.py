"""The `vacancyd` command: run the daemon, check a config, and talk to a running daemon.

This module is the command line itself: the argument parser, and for each command the
calls it makes and its exit code. How the daemon's documents read for a person (`status`,
`holds`) is in status_text.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import trio

from vacancyd import __version__, last_words, remote
from vacancyd.collect.attribution import server_pids
from vacancyd.config import load_config
from vacancyd.errors import ConfigError, StartupError
from vacancyd.footprint import command as footprint_command
from vacancyd.remote import EXIT_CONFIG, EXIT_FAILED, EXIT_OK, print_problems


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_CONFIG
    handler = {
        "run": _run,
        "check-config": _check_config,
        "status": remote.status,
        "pause": remote.pause,
        "resume": remote.resume,
        "holds": remote.holds,
        "release": remote.release,
        "debug": remote.debug,
        "diagnostics": remote.diagnostics,
        "footprint": _footprint,
        "agent": _agent,
        "fleet": _fleet,
    }[args.command]
    return handler(args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vacancyd",
        description="Lend this machine's idle GPU through a gated reverse proxy.",
    )
    parser.add_argument("--version", action="version", version=f"vacancyd {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    run = commands.add_parser("run", help="run the daemon (embedded default without --config)")
    run.add_argument("--config", metavar="FILE", help="configuration file (TOML)")

    check = commands.add_parser("check-config", help="validate a configuration file")
    check.add_argument("file", metavar="FILE")

    footprint = commands.add_parser(
        "footprint", help="estimate a model's memory footprint and print a config snippet"
    )
    footprint_command.add_arguments(footprint)

    for name, text in (
        ("status", "show what a running daemon reports"),
        ("pause", "stop lending (new borrowed work is refused)"),
        ("resume", "lend again"),
        ("holds", "list durable holds, and a holds file the daemon could not trust"),
        ("release", "end a durable hold, or clear an untrusted holds file"),
    ):
        sub = commands.add_parser(name, help=text)
        where = sub.add_mutually_exclusive_group()
        where.add_argument("--config", metavar="FILE", help="find the API address in this file")
        where.add_argument("--api", metavar="URL", help="the API's base URL")
        sub.add_argument("--token", help="bearer token (default: $VACANCYD_TOKEN or a token file)")
        if name in ("status", "holds"):
            sub.add_argument("--json", action="store_true", help="print the raw JSON document")
        if name == "release":
            _release_arguments(sub)
        if name == "pause":
            sub.add_argument(
                "--for",
                dest="for_s",
                metavar="DURATION",
                type=_duration,
                help="a snooze: lend again by itself after this long, e.g. 2h, 1h30m (at most 30d)",
            )
            sub.add_argument(
                "--now",
                action="store_true",
                help="also give the machine back at once: running borrowed work is reclaimed",
            )
    _operator_commands(commands)
    _agent_commands(commands)
    _fleet_command(commands)
    return parser


def _fleet_command(commands: Any) -> None:
    fleet = commands.add_parser(
        "fleet", help="every lender of a fleet in one table (exit 1 if one could not be read)"
    )
    source = fleet.add_mutually_exclusive_group(required=True)
    source.add_argument("--file", metavar="FILE", help="a fleet file ([[lender]] tables, TOML)")
    source.add_argument(
        "--litellm-config",
        metavar="FILE",
        help="a LiteLLM config.yaml: one lender per API its vacancy probes name",
    )
    fleet.add_argument(
        "--timeout", type=float, default=5.0, metavar="SECONDS", help="per lender (default 5)"
    )
    fleet.add_argument("--json", action="store_true", help="print the rows as JSON")


def _fleet(args: argparse.Namespace) -> int:
    from vacancyd.fleet import (
        COLUMNS,
        FleetError,
        fleet_rows,
        lenders_from_file,
        lenders_from_litellm,
        read_fleet,
        render_fleet,
    )

    try:
        if args.file:
            lenders = lenders_from_file(Path(args.file))
        else:
            lenders = lenders_from_litellm(Path(args.litellm_config))
    except FleetError as exc:
        print(f"vacancyd fleet: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    readings = trio.run(read_fleet, lenders, args.timeout)
    if args.json:
        rows = [dict(zip(COLUMNS, row, strict=True)) for row in fleet_rows(readings)]
        print(json.dumps(rows, indent=2))
    else:
        print(render_fleet(readings))
    return EXIT_FAILED if any(reading.status is None for reading in readings) else EXIT_OK


def _agent_commands(commands: Any) -> None:
    """`agent` (= `agent run`) runs the per-session agent; `agent pause|resume|status`
    put one command to the daemon over the agent's socket (no token: the daemon knows
    the caller from the socket)."""
    agent = commands.add_parser(
        "agent",
        help="the per-session agent: run it in the desktop session, or pause/resume/status",
    )
    actions = agent.add_subparsers(dest="agent_command", metavar="ACTION")
    run = actions.add_parser("run", help="report this desktop session to the daemon (default)")
    pause = actions.add_parser("pause", help="stop lending (new borrowed work is refused)")
    resume = actions.add_parser("resume", help="lend again")
    status = actions.add_parser("status", help="show the lending state")
    # Accepted before or after the action: `agent --socket X pause` and `agent pause
    # --socket X`; the action's copy only counts when given (SUPPRESS).
    for parser, default in ((agent, None), (run, argparse.SUPPRESS), (pause, argparse.SUPPRESS),
                            (resume, argparse.SUPPRESS), (status, argparse.SUPPRESS)):  # fmt: skip
        parser.add_argument(
            "--socket",
            metavar="PATH",
            default=default,
            help="the daemon's agent socket (default: $VACANCYD_AGENT_SOCKET, "
            "else /run/vacancyd/agent.sock)",
        )
    for parser, default in ((agent, None), (run, argparse.SUPPRESS)):
        parser.add_argument(
            "--heartbeat",
            metavar="DURATION",
            type=_heartbeat,
            default=default,
            help="report at least this often, e.g. 2s (default 2s)",
        )
        parser.add_argument(
            "--verbose", action="store_true", default=default, help="log at debug level"
        )
    pause.add_argument(
        "--for",
        dest="for_s",
        metavar="DURATION",
        type=_pause_duration,
        help="a snooze: lend again by itself after this long, e.g. 2h, 1h30m (at most 30d)",
    )
    pause.add_argument(
        "--now",
        action="store_true",
        help="also give the machine back at once: running borrowed work is reclaimed",
    )


def _operator_commands(commands: Any) -> None:
    """`debug` and `diagnostics`: the seed's tools for an owner chasing a problem."""
    debug = commands.add_parser("debug", help="log at debug for a while; it turns itself off")
    diagnostics = commands.add_parser(
        "diagnostics", help="write one archive for a bug report (secrets redacted)"
    )
    for sub in (debug, diagnostics):
        where = sub.add_mutually_exclusive_group()
        where.add_argument("--config", metavar="FILE", help="find the API address in this file")
        where.add_argument("--api", metavar="URL", help="the API's base URL")
        sub.add_argument("--token", help="admin token (default: $VACANCYD_TOKEN or a token file)")
    how_long = debug.add_mutually_exclusive_group(required=True)
    how_long.add_argument(
        "--for",
        dest="for_s",
        metavar="DURATION",
        type=_duration,
        help="how long, e.g. 10m, 1h30m (at most 7d)",
    )
    how_long.add_argument("--off", action="store_true", help="turn debug logging off now")
    diagnostics.add_argument(
        "-o",
        "--output",
        metavar="FILE",
        help="the archive to write (default: vacancyd-diagnostics-<time>.tar.gz here)",
    )


def _duration(text: str) -> float:
    from vacancyd.durations import parse_duration

    try:
        seconds = parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a duration must be longer than 0s")
    return seconds


def _heartbeat(text: str) -> float:
    from vacancyd.agent_protocol import MAX_HEARTBEAT_S, MIN_HEARTBEAT_S

    seconds = _duration(text)
    if not MIN_HEARTBEAT_S <= seconds <= MAX_HEARTBEAT_S:
        raise argparse.ArgumentTypeError(
            f"{text!r}: a heartbeat is from {MIN_HEARTBEAT_S:g}s to {MAX_HEARTBEAT_S:g}s"
        )
    return seconds


def _pause_duration(text: str) -> float:
    from vacancyd.agent_protocol import MAX_PAUSE_S
    from vacancyd.durations import describe_duration

    seconds = _duration(text)
    if seconds > MAX_PAUSE_S:
        raise argparse.ArgumentTypeError(
            f"{text!r}: a pause is at most {describe_duration(MAX_PAUSE_S)}"
        )
    return seconds


def _release_arguments(release: argparse.ArgumentParser) -> None:
    """`release JOB_ID` ends one hold; `release --unreadable-file` clears the file hold."""
    what = release.add_mutually_exclusive_group(required=True)
    what.add_argument(
        "job_id", nargs="?", type=int, metavar="JOB_ID", help="the held job (see `holds`)"
    )
    what.add_argument(
        "--unreadable-file",
        action="store_true",
        help="clear the hold of a holds file the daemon could not trust (moved aside, kept)",
    )


def _configure_logging(level: str) -> None:
    """stderr, in the journal's format when it is the journal (vacancyd.logs).

    httpx logs every request at INFO with its whole URL, borrowers' query strings
    included; those belong in the log only when the operator asks for debugging.
    """
    from vacancyd.logs import configure_logging

    configure_logging(level)


def _run(args: argparse.Namespace) -> int:
    from vacancyd.service import run_daemon
    from vacancyd.supervision import EssentialTaskFailed

    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print_problems(args.config or "<embedded default>", exc)
        return EXIT_CONFIG
    _configure_logging(config.server.log_level.value)
    log = logging.getLogger("vacancyd")
    # A wedged daemon is killed by systemd's watchdog with SIGABRT: leave every thread's
    # stack in the log, so the bug report shows where it was stuck (see last_words.py).
    last_words.arm(log)
    log.info(
        "vacancyd %s starting with %s", __version__, args.config or "the embedded default config"
    )
    try:
        trio.run(run_daemon, config)
    except StartupError as exc:
        log.critical("cannot start: %s", exc)
        return EXIT_FAILED
    except BaseExceptionGroup as group:
        failed = group.subgroup(lambda e: isinstance(e, EssentialTaskFailed | StartupError))
        for leaf in _leaves(failed or group):
            log.critical("vacancyd is exiting: %s", leaf)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return EXIT_OK
    return EXIT_OK


def _leaves(group: BaseException) -> list[BaseException]:
    if isinstance(group, BaseExceptionGroup):
        return [leaf for inner in group.exceptions for leaf in _leaves(inner)]
    return [group]


def _footprint(args: argparse.Namespace) -> int:
    # Ollama's settings are read from its server's environment: found by its socket.
    return footprint_command.run(args, find_server=server_pids)


def _check_config(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.file)
    except ConfigError as exc:
        print_problems(args.file, exc)
        return EXIT_CONFIG
    print(
        f"{args.file}: ok ({len(config.resource)} resource(s), {len(config.upstream)} upstream(s))"
    )
    return EXIT_OK


def _agent(args: argparse.Namespace) -> int:
    """Run the session agent, or put one owner's command to the daemon through it."""
    from vacancyd.agent.commands import CommandFailed, render_answer, send_command
    from vacancyd.agent.link import socket_path
    from vacancyd.agent_protocol import Command

    action = args.agent_command or "run"
    if action == "run":
        return _run_agent(args)
    command = Command(
        action, for_s=getattr(args, "for_s", None), now=bool(getattr(args, "now", False))
    )
    try:
        answer = send_command(socket_path(args.socket, os.environ), command)
    except CommandFailed as exc:
        print(f"vacancyd agent: {exc}", file=sys.stderr)
        return EXIT_FAILED
    print(render_answer(answer), file=sys.stdout if answer.ok else sys.stderr)
    return EXIT_OK if answer.ok else EXIT_FAILED


def _run_agent(args: argparse.Namespace) -> int:
    from functools import partial

    from vacancyd.agent.loop import AgentSettings, run_agent

    _configure_logging("debug" if args.verbose else "info")
    settings = AgentSettings.from_environment(
        os.environ, socket=args.socket, heartbeat_s=args.heartbeat
    )
    # SIGINT before the agent's own signal handling is up ends it the same way.
    with contextlib.suppress(KeyboardInterrupt):
        trio.run(partial(run_agent, settings, handle_signals=True))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
