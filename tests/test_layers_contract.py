"""The layers contract names every module of the package, so it cannot drift.

import-linter checks only the modules a contract names: a module left out of the layers
contract may import anything, and nobody notices. This test fails as soon as a new
top-level module or package is added to vacancyd/ without a place in the layers, or one
named there is removed or renamed.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "vacancyd"
CONTRACT = "layers point downwards"


def _layers() -> list[list[str]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contracts = config["tool"]["importlinter"]["contracts"]
    (layers,) = [c["layers"] for c in contracts if c["name"] == CONTRACT]
    # A layer is "a | b" (independent siblings) or "a : b"; "(a)" marks an optional module.
    return [[name.strip().strip("()") for name in re.split(r"[|:]", layer)] for layer in layers]


def _top_level_modules() -> set[str]:
    modules = {
        f"vacancyd.{path.stem}" for path in PACKAGE.glob("*.py") if path.name != "__init__.py"
    }
    packages = {f"vacancyd.{path.parent.name}" for path in PACKAGE.glob("*/__init__.py")}
    return modules | packages


def test_every_module_of_the_package_has_a_layer() -> None:
    named = {name for layer in _layers() for name in layer}
    missing = sorted(_top_level_modules() - named)
    assert not missing, f"not in the {CONTRACT!r} contract in pyproject.toml: {missing}"


def test_the_layers_name_only_modules_that_exist_and_each_once() -> None:
    named = [name for layer in _layers() for name in layer]
    assert sorted(set(named) - _top_level_modules()) == []
    assert len(named) == len(set(named))


MAX_LINES = 500
SIZE_REASON = "Over 500 lines on purpose:"


def test_no_module_is_over_500_lines_without_saying_why() -> None:
    """A long module is split, or says in its docstring why it is one (issue 21)."""
    unexplained = [
        str(path.relative_to(ROOT))
        for path in sorted(PACKAGE.rglob("*.py"))
        if len(path.read_text().splitlines()) > MAX_LINES and SIZE_REASON not in path.read_text()
    ]
    assert unexplained == []
