"""Reading spills from /api/ps as hostile input, and how long a reading is believed."""

from __future__ import annotations

from vacancyd.adapters.ollama_actions import ResidentModel, parse_ps
from vacancyd.admission.borrowed_loads import LOAD_MIN_MIB, BorrowedLoads
from vacancyd.admission.spills import SPILL_FRESH_S, SpilledModels
from vacancyd.handoff_plan import Spill

MIB = 1024 * 1024


def test_a_row_is_spilled_only_when_both_sizes_are_usable_and_the_gpu_holds_less() -> None:
    rows = parse_ps(
        {
            "models": [
                {"name": "whole", "size": 10 * MIB, "size_vram": 10 * MIB},
                {"name": "spilled", "size": 10 * MIB, "size_vram": 6 * MIB},
                {"name": "no size", "size_vram": 6 * MIB},
                {"name": "odd size", "size": True, "size_vram": 6 * MIB},
                {"name": "negative", "size": -1, "size_vram": 6 * MIB},
                {"name": "on the cpu", "size": 10 * MIB, "size_vram": 0},
            ]
        }
    )
    assert [row.name for row in rows if row.spilled] == ["spilled", "on the cpu"]
    assert rows[3] == ResidentModel("odd size", 6 * MIB, None)


def test_a_spill_is_believed_for_a_while_and_under_its_bare_name() -> None:
    spills = SpilledModels()
    spills.seen("ollama", (Spill("chat:latest", 10240, 6144, seen_at=100.0),))
    assert spills.get("ollama", "chat", 100.0) == spills.get("ollama", "chat:latest", 100.0)
    assert spills.get("ollama", "chat:7b", 100.0) is None
    assert spills.get("other", "chat", 100.0) is None
    assert spills.get("ollama", "chat", 100.0 + SPILL_FRESH_S) is not None
    assert spills.get("ollama", "chat", 100.0 + SPILL_FRESH_S + 0.1) is None
    spills.forget("ollama", "chat:latest")
    assert spills.of("ollama") == ()


def test_borrowed_loads_keep_measured_loads_and_their_idle_clock() -> None:
    loads = BorrowedLoads()
    assert not loads.loaded("ollama", "tiny", "gpu0", LOAD_MIN_MIB - 1, at=1.0)
    assert loads.loaded("ollama", "chat", "gpu0", 6144, at=1.0)
    assert loads.loaded("comfy", None, "gpu0", 8192, at=2.0)
    loads.used("ollama", at=5.0)
    [chat] = loads.of("ollama")
    assert (chat.loaded_at, chat.last_used) == (1.0, 5.0)
    # A later load of the same model keeps when it was first loaded.
    loads.loaded("ollama", "chat", "gpu0", 6000, at=7.0)
    [chat] = loads.on("gpu0", "ollama")
    assert (chat.mib, chat.loaded_at, chat.last_used) == (6000, 1.0, 7.0)
    loads.forget_model("ollama", "chat")
    assert loads.of("ollama") == () and len(loads.of("comfy")) == 1
    loads.forget("comfy")
    assert loads.of("comfy") == ()
