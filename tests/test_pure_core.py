"""The pure core loads no clock, network or driver library when it is imported.

import-linter's "pure core" contract (pyproject.toml) checks the imports written in each
module. What it cannot see is a parent package that imports eagerly: before, importing
the front-door rule ran `vacancyd/adapters/__init__.py`, which loaded httpx, trio and the
ledger. This runs the import in a fresh interpreter and looks at what was loaded.

Modules inside `admission/`, `collect/nvml/` and `footprint/` are held by the contract
only: those packages' `__init__` files gather their public names for the service, so
importing any of their modules loads the package's live parts too.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

PURE = [
    "vacancyd.gate",
    "vacancyd.model",
    "vacancyd.judgement",
    "vacancyd.heat",
    "vacancyd.schedule",
    "vacancyd.edges",
    "vacancyd.reclaim_plan",
    "vacancyd.handoff_plan",
    "vacancyd.access",
    "vacancyd.adapters.routes",
    "vacancyd.proxy.policy",
]
LIVE = ["trio", "httpx", "h11", "hypercorn", "quart", "psutil", "pynvml", "jeepney"]


@pytest.mark.parametrize("module", PURE)
def test_importing_a_pure_rule_loads_nothing_live(module: str) -> None:
    probe = (
        f"import sys, {module}\n"
        f"print(' '.join(m for m in {LIVE!r} if m in sys.modules))\n"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('vacancyd.'))))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    live, ours = done.stdout.splitlines()
    assert live == "", f"importing {module} loaded {live}"
    for stateful in ("vacancyd.state", "vacancyd.admission.ledger", "vacancyd.adapters.actions"):
        assert stateful not in ours.split()
