"""docs/routes.md and the adapters' route tables say the same thing, in both directions.

Each row of the page is classified through the real adapter and must come out as the row
says; each route an adapter lists must have its row, with the same methods and class. The
lines naming health checks and dropped request headers are checked against the adapter
too. So an edit to either side that the other does not follow fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

import attrs
import pytest

from vacancyd.adapters.registry import adapter_for, adapter_names
from vacancyd.adapters.routes import RouteClass

DOC = Path(__file__).resolve().parent.parent / "docs" / "routes.md"
SAMPLE_SEGMENT = "x-1.safetensors"

_HEADING = re.compile(r"^## `([a-z0-9_]+)`\s*$")
_HEALTH = re.compile(r"^Health checks \(management with a query string\): (.+)\.$")
_HEADERS = re.compile(r"^Request headers not forwarded: (.+)\.$")
_CODE = re.compile(r"`([^`]+)`")


@attrs.frozen
class Row:
    adapter: str
    methods: frozenset[str]
    path: str
    route_class: RouteClass
    why: str
    line: int


@attrs.define
class Section:
    rows: list[Row] = attrs.Factory(list)
    health: frozenset[str] | None = None
    dropped: frozenset[bytes] | None = None


def _names(text: str) -> list[str]:
    return [] if text == "none" else _CODE.findall(text)


def parse(text: str) -> dict[str, Section]:
    """The page's per-adapter sections: table rows, health checks, dropped headers."""
    sections: dict[str, Section] = {}
    current: Section | None = None
    name = ""
    for number, line in enumerate(text.splitlines(), start=1):
        if heading := _HEADING.match(line):
            name = heading.group(1)
            assert name not in sections, f"line {number}: {name} has two sections"
            current = sections[name] = Section()
            continue
        if current is None:
            continue
        if health := _HEALTH.match(line):
            current.health = frozenset(_names(health.group(1)))
        elif headers := _HEADERS.match(line):
            current.dropped = frozenset(n.encode() for n in _names(headers.group(1)))
        elif line.startswith("|") and not line.startswith(("| Method |", "|---")):
            cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
            assert len(cells) == 4, f"line {number}: expected 4 cells, got {cells}"
            methods, path, route_class, why = cells
            paths = _CODE.findall(path)
            assert len(paths) == 1 and path == f"`{paths[0]}`", f"line {number}: {path}"
            current.rows.append(
                Row(
                    adapter=name,
                    methods=frozenset(m.strip() for m in methods.split(",")),
                    path=paths[0],
                    route_class=RouteClass(route_class),
                    why=why,
                    line=number,
                )
            )
    return sections


SECTIONS = parse(DOC.read_text(encoding="utf-8"))
ROWS = [row for section in SECTIONS.values() for row in section.rows]


def concrete(path: str) -> str:
    return re.sub(r"\{[a-z_]+\}", SAMPLE_SEGMENT, path)


def test_every_adapter_has_a_section_and_every_section_an_adapter() -> None:
    assert sorted(SECTIONS) == adapter_names()
    for name, section in SECTIONS.items():
        assert section.rows, name
        assert section.health is not None, f"{name}: no health checks line"
        assert section.dropped is not None, f"{name}: no request headers line"


def test_no_row_is_listed_twice() -> None:
    seen: dict[tuple[str, str, str], int] = {}
    for row in ROWS:
        for method in row.methods:
            key = (row.adapter, method, row.path)
            assert key not in seen, f"line {row.line} repeats line {seen[key]}"
            seen[key] = row.line


@pytest.mark.parametrize(
    "row", [pytest.param(row, id=f"{row.adapter}-{row.line}-{row.path}") for row in ROWS]
)
def test_each_row_classifies_as_the_page_says(row: Row) -> None:
    adapter = adapter_for(row.adapter)
    for method in sorted(row.methods):
        got = adapter.classify(method, concrete(row.path).encode(), b"")
        assert got.route_class is row.route_class, (method, row.path, got.why)
        if row.route_class is RouteClass.UNKNOWN:
            assert got.route is None
        else:
            assert got.route is not None and got.route.path == row.path
            assert got.route.methods == row.methods, f"line {row.line}: methods differ"
            if row.route_class is RouteClass.WORK:
                # The page says which work routes carry no JSON body to read a model from.
                no_json = "multipart" in row.why or "WebSocket" in row.why
                assert got.route.json_body is not no_json, f"line {row.line}"


@pytest.mark.parametrize("name", adapter_names())
def test_each_listed_route_has_its_row(name: str) -> None:
    documented = {
        (row.methods, row.path, row.route_class)
        for row in SECTIONS[name].rows
        if row.route_class is not RouteClass.UNKNOWN
    }
    missing = [
        f"{', '.join(sorted(route.methods))} {route.path} ({route.route_class.value})"
        for route in adapter_for(name).routes
        if (route.methods, route.path, route.route_class) not in documented
    ]
    assert missing == [], f"docs/routes.md lacks rows for {name}: {missing}"


@pytest.mark.parametrize("name", adapter_names())
def test_health_checks_and_dropped_headers_match(name: str) -> None:
    adapter = adapter_for(name)
    assert SECTIONS[name].health == adapter.health_paths
    assert SECTIONS[name].dropped == adapter.drop_request_headers
