"""docs/api.md's /status example cannot drift silently from a real daemon's answer.

The example is abridged, so the check runs both ways with different strictness: every
field the example shows must exist at the same place in a real /status (docs never
invent fields), and every field a real /status has must be named somewhere in
docs/api.md (nothing is added without being documented).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx

from tests.support.configs import one_upstream_config
from tests.support.daemon import in_process_daemon

API_DOC = Path(__file__).resolve().parents[1] / "docs" / "api.md"
# Maps keyed by names the operator chose (resources, upstreams, borrowers...), and inputs
# copied from the gate: their keys are data, not fields.
DATA_KEYED = {"refused", "busy_refusals", "collectors", "inputs", "per_upstream", "held_s"}


def status_example() -> dict[str, Any]:
    text = API_DOC.read_text("utf-8")
    start = text.index("### `GET /status` (read)")
    body = text.index("```json", start) + len("```json")
    example: dict[str, Any] = json.loads(text[body : text.index("```", body)])
    return example


def fields(value: Any, path: str = "") -> set[str]:
    """Dotted paths of every dict key (lists: their first element's, as `path[]`)."""
    found: set[str] = set()
    if isinstance(value, dict):
        for key, item in value.items():
            here = f"{path}.{key}" if path else key
            found.add(here)
            if key not in DATA_KEYED:
                found |= fields(item, here)
    elif isinstance(value, list) and value and isinstance(value[0], dict):
        found |= fields(value[0], path + "[]")
    return found


def names(value: Any) -> set[str]:
    """Every field name (not data key) in a document."""
    return {path.rsplit(".", 1)[-1].removesuffix("[]") for path in fields(value)}


async def real_status(tmp_path: Path) -> dict[str, Any]:
    # As in the example: one memory resource, one llama.cpp upstream whose target is a
    # closed port, one work request admitted and then failed with 502.
    text = one_upstream_config(
        "http://127.0.0.1:9",
        tmp_path / "state",
        adapter="llamacpp",
        name="llama",
        upstream_extra="default_need_mib = { ram = 512 }",
    )
    async with (
        in_process_daemon(text) as daemon,
        httpx.AsyncClient(trust_env=False, timeout=10) as http,
    ):
        failed = await http.post(f"{daemon.proxy('llama')}/v1/completions", json={"prompt": "x"})
        assert failed.status_code == 502
        document: dict[str, Any] = (await http.get(f"{daemon.api}/status")).json()
    return document


def known_names(value: Any) -> set[str]:
    return {re.sub(r"\[\]$", "", name) for name in names(value)}


async def test_every_field_the_example_shows_is_in_a_real_status(tmp_path: Path) -> None:
    real = await real_status(tmp_path)
    example = status_example()
    # Names of things (resources, upstreams, borrowers) are data: compare the example's
    # entry for each with the real one under the same name.
    missing = sorted(fields(example) - fields(real))
    assert missing == [], f"docs/api.md's /status example shows fields a daemon lacks: {missing}"


async def test_every_field_of_a_real_status_is_documented(tmp_path: Path) -> None:
    real = await real_status(tmp_path)
    text = API_DOC.read_text("utf-8")
    undocumented = sorted(
        name for name in known_names(real) if f"`{name}`" not in text and f'"{name}"' not in text
    )
    assert undocumented == [], f"/status fields docs/api.md never names: {undocumented}"
