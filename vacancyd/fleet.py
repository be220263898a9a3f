"""`vacancyd fleet`: every lender of a home lab in one table.

Each lender is asked what `vacancyd status` asks one (`GET /status`), plus its vacancy
probe for each upstream (`GET /vacancy/<upstream>`, the answer a gateway gets), all at
once and each under a deadline, so one lender that is down costs one row that says so,
never the whole table. The lenders come from a small TOML file:

    [[lender]]
    name = "desk-a"                       # optional: the API's host:port otherwise
    api = "http://desk-a:9460"
    token_env = "DESK_A_READ_TOKEN"       # optional: a read-scope token, from the environment

or from a LiteLLM config whose deployments name vacancy probes (`model_info.vacancy_probe`,
docs/gateways.md): each distinct API there is one lender, its token the probe's.

Fetching and reading are kept apart: `fleet_rows` turns documents into rows and needs
nothing else, so a test can render any document it holds.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import attrs
import httpx
import trio

from vacancyd.vacancy_probe import probe_of

COLUMNS = ("LENDER", "LENDING", "OWNER", "FREE / SPARE", "RESIDENT", "RUNNING", "LAST REFUSAL")


class FleetError(Exception):
    """A fleet file or LiteLLM config that cannot be used, in words for the operator."""


@attrs.frozen
class Lender:
    name: str
    api: str
    token: str | None = None


@attrs.frozen
class Reading:
    """One lender as read: its /status and each upstream's probe, or why it could not be."""

    lender: Lender
    status: Mapping[str, Any] | None = None
    vacancy: Mapping[str, Mapping[str, Any]] = attrs.Factory(dict)
    problem: str | None = None


# -- where the lenders come from -------------------------------------------------------------


def lenders_from_file(path: Path) -> list[Lender]:
    """The `[[lender]]` tables of a fleet file."""
    try:
        document = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise FleetError(f"{path}: {exc}") from exc
    tables = document.get("lender")
    if not isinstance(tables, list) or not tables:
        raise FleetError(f"{path}: no [[lender]] tables")
    lenders = []
    for number, table in enumerate(tables):
        where = f"{path}: lender[{number}]"
        if not isinstance(table, dict):
            raise FleetError(f"{where}: expected a table")
        unknown = set(table) - {"name", "api", "token_env"}
        if unknown:
            raise FleetError(f"{where}: unknown keys {', '.join(sorted(unknown))}")
        api = table.get("api")
        if not isinstance(api, str) or urlsplit(api).scheme not in ("http", "https"):
            raise FleetError(f"{where}.api: expected an http(s) URL, got {api!r}")
        token_env = table.get("token_env")
        if token_env is not None and not isinstance(token_env, str):
            raise FleetError(f"{where}.token_env: expected the name of a variable")
        name = table.get("name") or urlsplit(api).netloc
        if not isinstance(name, str):
            raise FleetError(f"{where}.name: expected a string")
        token = os.environ.get(token_env) if token_env else None
        lenders.append(Lender(name, api.rstrip("/"), token or None))
    return lenders


def lenders_from_litellm(path: Path) -> list[Lender]:
    """One lender per distinct API named by a deployment's vacancy probe."""
    try:
        import yaml  # LiteLLM's own dependency; the daemon does not need it
    except ImportError as exc:
        raise FleetError("reading a LiteLLM config needs PyYAML (pip install pyyaml)") from exc
    try:
        document = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise FleetError(f"{path}: {exc}") from exc
    models = document.get("model_list") if isinstance(document, dict) else None
    lenders: dict[str, Lender] = {}
    for deployment in models if isinstance(models, list) else []:
        probe = probe_of(deployment)
        if probe is None or "/vacancy/" not in probe.url:
            continue
        api = probe.url.split("/vacancy/", 1)[0].rstrip("/")
        lenders.setdefault(api, Lender(urlsplit(api).netloc, api, probe.token))
    if not lenders:
        raise FleetError(f"{path}: no deployment names a vacancy probe (model_info.vacancy_probe)")
    return list(lenders.values())


# -- reading them ------------------------------------------------------------------------------


async def read_fleet(lenders: Sequence[Lender], timeout_s: float) -> list[Reading]:
    """Every lender's reading, all at once, each within `timeout_s`."""
    readings: list[Reading | None] = [None] * len(lenders)

    async def one(index: int, lender: Lender) -> None:
        readings[index] = await read_lender(lender, timeout_s)

    async with trio.open_nursery() as nursery:
        for index, lender in enumerate(lenders):
            nursery.start_soon(one, index, lender)
    return [reading for reading in readings if reading is not None]


async def read_lender(lender: Lender, timeout_s: float) -> Reading:
    headers = {"Authorization": f"Bearer {lender.token}"} if lender.token else {}
    try:
        with trio.fail_after(timeout_s):
            async with httpx.AsyncClient(
                trust_env=False, follow_redirects=False, headers=headers
            ) as client:
                answer = await client.get(f"{lender.api}/status")
                if answer.status_code != 200:
                    return Reading(lender, problem=f"/status answered {answer.status_code}")
                status = answer.json()
                vacancy = {}
                for upstream in status.get("upstreams") or {}:
                    probe = await client.get(f"{lender.api}/vacancy/{upstream}")
                    vacancy[upstream] = probe.json()
    except trio.TooSlowError:
        return Reading(lender, problem=f"no answer within {timeout_s:g}s")
    except (httpx.HTTPError, OSError) as exc:
        return Reading(lender, problem=f"unreachable ({type(exc).__name__})")
    except ValueError:
        return Reading(lender, problem="answered something that is not vacancyd's JSON")
    if not isinstance(status, dict):
        return Reading(lender, problem="answered something that is not vacancyd's JSON")
    return Reading(lender, status, vacancy)


# -- the table -----------------------------------------------------------------------------------


def fleet_rows(readings: Sequence[Reading]) -> list[tuple[str, ...]]:
    """One row per lender, in COLUMNS' order."""
    return [_row(reading) for reading in readings]


def render_fleet(readings: Sequence[Reading]) -> str:
    rows = [COLUMNS, *fleet_rows(readings)]
    widths = [max(len(row[column]) for row in rows) for column in range(len(COLUMNS))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def _row(reading: Reading) -> tuple[str, ...]:
    name = reading.lender.name
    status = reading.status
    if status is None:
        return (name, f"DOWN: {reading.problem}", "-", "-", "-", "-", "-")
    try:
        return (
            name,
            _lending(status, reading.vacancy),
            _owner(status),
            _resources(status),
            _resident(status),
            _running(status),
            _last_refusal(status),
        )
    except (KeyError, TypeError, AttributeError, ValueError):
        return (name, "UNREADABLE: /status lacks what this vacancyd expects", *["-"] * 5)


def _lending(status: Mapping[str, Any], vacancy: Mapping[str, Mapping[str, Any]]) -> str:
    """Each upstream's probe answer: what a gateway is told now."""
    words = []
    for upstream in status["upstreams"]:
        answer = vacancy.get(upstream) or {}
        if answer.get("vacancy") is True:
            words.append(f"{upstream}: yes")
        else:
            reason = (answer.get("error") or {}).get("code") or "unknown"
            words.append(f"{upstream}: no ({reason})")
    return ", ".join(words) or "no upstreams"


def _owner(status: Mapping[str, Any]) -> str:
    presence = status["presence"]
    session = presence.get("session") or "unknown"
    present = status["owner_veto"]["engaged"] or presence.get("refuses") is not None
    return f"{'present' if present else 'away'} ({session})"


def _resources(status: Mapping[str, Any]) -> str:
    words = []
    for name, resource in status["resources"].items():
        free = resource.get("free_bytes")
        spare = resource.get("spare_mib")
        free_words = "?" if free is None else f"{free // (1024 * 1024)}"
        spare_words = "?" if spare is None else f"{spare}"
        words.append(f"{name} {free_words}/{spare_words} MiB")
    return ", ".join(words) or "-"


def _resident(status: Mapping[str, Any]) -> str:
    models = [
        f"{name}: {upstream['residency']['model']}"
        for name, upstream in status["upstreams"].items()
        if (upstream.get("residency") or {}).get("proved") and upstream["residency"].get("model")
    ]
    return ", ".join(models) or "-"


def _running(status: Mapping[str, Any]) -> str:
    jobs = [job for upstream in status["upstreams"].values() for job in upstream["active_work"]]
    if not jobs:
        return "-"
    held = sum(job["phase"] == "held" for job in jobs)
    return f"{len(jobs)} job{'s' if len(jobs) != 1 else ''}" + (f" ({held} held)" if held else "")


def _last_refusal(status: Mapping[str, Any]) -> str:
    refusals = [
        upstream["last_refusal"]
        for upstream in status["upstreams"].values()
        if upstream.get("last_refusal")
    ]
    if not refusals:
        return "-"
    last = min(refusals, key=lambda refusal: refusal.get("age_s") or 0.0)
    return f"{last['reason']} {last.get('age_s', 0):.0f}s ago"
