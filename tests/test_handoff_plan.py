"""The hand-off rule as a table: which idle borrowed models may give way, and why not."""

from __future__ import annotations

import attrs
import pytest

from vacancyd.handoff_plan import BorrowedLoad, Giver, plan_handoff

NOW = 1000.0


def load(upstream: str, mib: int, *, model: str = "m", last_used: float = 0.0) -> BorrowedLoad:
    return BorrowedLoad(upstream, model, "gpu0", mib, loaded_at=0.0, last_used=last_used)


def giver(name: str, *loads: BorrowedLoad, **changes: object) -> Giver:
    base = Giver(
        upstream=name,
        can_release=True,
        cannot_release="",
        priority=0,
        idle_s=60.0,
        running_jobs=0,
        loads=loads,
    )
    return attrs.evolve(base, **changes)


IDLE = giver("ollama", load("ollama", 8192))


@pytest.mark.parametrize(
    ("givers", "shortfall", "chosen", "enough", "named"),
    [
        # An idle borrowed model that closes the gap is asked for.
        ((IDLE,), 1024, ["ollama"], True, ""),
        # Exactly enough is enough.
        ((IDLE,), 8192, ["ollama"], True, ""),
        # Not enough even with all of it: nothing is worth evicting.
        ((IDLE,), 9000, ["ollama"], False, "the 8192 MiB that idle borrowed models hold"),
        # Running or held work keeps the model, whatever the idle clock says.
        (
            (attrs.evolve(IDLE, running_jobs=2),),
            1024,
            [],
            False,
            "ollama is running borrowed work (2 job(s)), so its model stays",
        ),
        # Used too recently.
        (
            (giver("ollama", load("ollama", 8192, last_used=NOW - 3)),),
            1024,
            [],
            False,
            "ollama was used 3s ago (it gives way after 60s idle)",
        ),
        # Idle for exactly handoff_idle_s counts as idle.
        ((giver("ollama", load("ollama", 8192, last_used=NOW - 60)),), 1024, ["ollama"], True, ""),
        # A server that did not give memory back in time is not asked again for a while.
        (
            (attrs.evolve(IDLE, failed_at=NOW - 10),),
            1024,
            [],
            False,
            "ollama did not give memory back when asked 10s ago (asked again after 60s)",
        ),
        ((attrs.evolve(IDLE, failed_at=NOW - 60),), 1024, ["ollama"], True, ""),
        # A server with a higher priority keeps its model.
        (
            (attrs.evolve(IDLE, priority=5),),
            1024,
            [],
            False,
            "ollama has a higher hand-off priority (5 > 0)",
        ),
        # A server that cannot release is named with why, loads or not.
        (
            (giver("llama", can_release=False, cannot_release="llama-server has no unload"),),
            1024,
            [],
            False,
            "llama cannot give memory back (llama-server has no unload)",
        ),
        # What the server held before any borrower came is never a candidate.
        ((giver("ollama"),), 1024, [], False, "ollama holds no model a borrower loaded"),
        ((giver("ollama", running_jobs=1),), 1024, [], False, "ollama is running borrowed work"),
        # No other server on the GPU: nothing to say.
        ((), 1024, [], False, "no other server on it holds a model a borrower loaded"),
    ],
)
def test_plan(
    givers: tuple[Giver, ...], shortfall: int, chosen: list[str], enough: bool, named: str
) -> None:
    plan = plan_handoff(0, shortfall, givers, NOW)
    assert [entry.upstream for entry in plan.loads] == chosen
    assert plan.enough is enough
    if named:
        assert named in plan.why_not(named=True)


def test_the_largest_idle_models_go_first_and_no_more_than_needed() -> None:
    small = giver("tts", load("tts", 2048, model="voice"))
    big = giver("ollama", load("ollama", 8192, model="big"), load("ollama", 4096, model="mid"))
    plan = plan_handoff(0, 3000, (small, big), NOW)
    assert [entry.model for entry in plan.loads] == ["big"]
    assert plan.freed_mib == 8192 and plan.givers == ("ollama",)
    plan = plan_handoff(0, 12000, (small, big), NOW)
    assert [entry.model for entry in plan.loads] == ["big", "mid"]
    plan = plan_handoff(0, 13000, (small, big), NOW)
    assert [entry.model for entry in plan.loads] == ["big", "mid", "voice"]
    assert plan.givers == ("ollama", "tts")


def test_a_borrower_reads_the_reasons_without_the_servers_names() -> None:
    busy = attrs.evolve(IDLE, running_jobs=1)
    llama = giver("llama", can_release=False, cannot_release="llama-server has no unload")
    plan = plan_handoff(0, 1024, (busy, llama), NOW)
    assert plan.why_not(named=False) == (
        "a server is running borrowed work (1 job(s)), so its model stays; "
        "a server cannot give memory back (llama-server has no unload)"
    )
    assert "ollama" in plan.why_not(named=True) and "llama " in plan.why_not(named=True)


def test_a_requester_of_equal_or_higher_priority_may_ask() -> None:
    ranked = attrs.evolve(IDLE, priority=3)
    assert plan_handoff(3, 1024, (ranked,), NOW).enough
    assert plan_handoff(4, 1024, (ranked,), NOW).enough
    assert not plan_handoff(2, 1024, (ranked,), NOW).enough
