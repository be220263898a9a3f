"""Footprints in admission: configured, else learned, else estimated, with the default as
a floor; estimates from the real llama-server's model file; loads measured across
exclusive jobs."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
import trio
import trio.testing

from tests.support.configs import BASIC, config_from, one_upstream_config
from vacancyd.admission import Admission, Ledger, Reservation, need_for
from vacancyd.config import UpstreamConfig, parse_config
from vacancyd.decisions import DecisionLog
from vacancyd.footprint.book import FootprintBook
from vacancyd.model import (
    MIB,
    FootprintHint,
    Observation,
    PresenceReading,
    PressureQuality,
    PressureView,
    Reason,
    Refuse,
    SessionState,
)
from vacancyd.persist import StateFileProblems
from vacancyd.state import SharedState

CONFIG = config_from(BASIC)
RESOURCES = {r.name: r for r in CONFIG.resource}
LLAMA = CONFIG.upstream[0]
LEARNED = FootprintHint({"ram": 3000}, "learned", "measured")


@pytest.mark.parametrize(
    ("model", "hint", "need", "source"),
    [
        ("big", LEARNED, {"ram": 8000}, "configured"),  # configured always wins
        ("other", LEARNED, {"ram": 3000}, "learned"),
        ("other", FootprintHint({"ram": 700}, "estimated"), {"ram": 700}, "estimated"),
        ("other", None, {"ram": 500}, "default"),
        ("other", FootprintHint({}, "estimated"), {"ram": 500}, "default"),
    ],
)
def test_the_footprint_order(
    model: str, hint: FootprintHint | None, need: dict[str, int], source: str
) -> None:
    got = need_for(LLAMA, RESOURCES, model, hint)
    assert (got.need_mib, got.source) == (need, source)


def with_default(default: dict[str, int]) -> UpstreamConfig:
    """The upstream on gpu0 with ram as well, and this default."""
    return attrs.evolve(LLAMA, resource="gpu0", also_requires=["ram"], default_need_mib=default)


@pytest.mark.parametrize(
    ("default", "hint", "need", "sources"),
    [
        # An explicit default is a floor: an estimate below it is charged the default ...
        (
            {"gpu0": 9000},
            FootprintHint({"gpu0": 7000}, "estimated"),
            {"gpu0": 9000},
            {"gpu0": "default"},
        ),
        # ... one above it is charged in full.
        (
            {"gpu0": 5000},
            FootprintHint({"gpu0": 7000}, "estimated"),
            {"gpu0": 7000},
            {"gpu0": "estimated"},
        ),
        # A resource the hint does not cover keeps the default (an estimate sizes the
        # primary resource only; it never stops the others being charged).
        (
            {"gpu0": 5000, "ram": 2048},
            FootprintHint({"gpu0": 7000}, "estimated"),
            {"gpu0": 7000, "ram": 2048},
            {"gpu0": "estimated", "ram": "default"},
        ),
        # Learned and estimated side by side, each per resource; no default: no floor.
        (
            {},
            FootprintHint({"gpu0": 7000, "ram": 300}, "estimated", "", {"ram": "learned"}),
            {"gpu0": 7000, "ram": 300},
            {"gpu0": "estimated", "ram": "learned"},
        ),
        ({"gpu0": 5000}, None, {"gpu0": 5000}, {"gpu0": "default"}),
    ],
)
def test_the_default_is_a_floor_under_what_was_found(
    default: dict[str, int],
    hint: FootprintHint | None,
    need: dict[str, int],
    sources: dict[str, str],
) -> None:
    got = need_for(with_default(default), RESOURCES, "other", hint)
    assert (got.need_mib, got.sources) == (need, sources)
    assert got.source == sources["gpu0"]  # the primary resource's


def ready_state() -> SharedState:
    state = SharedState(CONFIG)
    now = trio.current_time()
    state.record_presence(PresenceReading("test", now, SessionState.LOGGED_OUT))
    state.record_observation(Observation("ram", now, 32 * 1024 * MIB, 4000 * MIB))
    state.record_observation(Observation("cpu", now, utilization_pct=10.0))
    state.record_observation(Observation("gpu0", now, 24_000 * MIB, 20_000 * MIB))
    state.record_pressure("gpu0", PressureView(PressureQuality.READY))
    return state


async def test_a_refusal_says_which_footprint_it_charged() -> None:
    state = ready_state()
    admission = Admission(state, Ledger(state), DecisionLog(["llama"]))
    hint = FootprintHint({"ram": 5000}, "estimated", "from its GGUF")
    refused = await admission.admit(LLAMA, "other", hint=hint)
    assert isinstance(refused, Refuse) and refused.reason is Reason.INSUFFICIENT_CAPACITY
    assert "other needs 5000 MiB of ram (estimated footprint)" in refused.detail
    assert refused.internal == "ram: estimated 5000 MiB; from its GGUF"


async def test_a_refusal_under_the_defaults_floor_names_the_floor() -> None:
    state = ready_state()
    admission = Admission(state, Ledger(state), DecisionLog(["llama"]))
    upstream = attrs.evolve(LLAMA, default_need_mib={"ram": 6000})
    hint = FootprintHint({"ram": 700}, "estimated", "from its GGUF")
    refused = await admission.admit(upstream, "other", hint=hint)
    assert isinstance(refused, Refuse) and refused.reason is Reason.INSUFFICIENT_CAPACITY
    assert "other needs 6000 MiB of ram (default footprint)" in refused.detail
    assert "the default 6000 MiB, a floor above the estimated 700 MiB" in refused.for_operator


def on_gpu() -> UpstreamConfig:
    return attrs.evolve(LLAMA, resource="gpu0", also_requires=[], default_need_mib={"gpu0": 100})


async def test_a_load_is_measured_by_the_fall_of_free_memory_across_its_job(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    state = ready_state()
    admission = Admission(state, Ledger(state), DecisionLog(["llama"]))
    job = await admission.admit(on_gpu(), "other")
    assert isinstance(job, Reservation) and job.free_before_mib == {"gpu0": 20_000}
    await trio.sleep(1)
    admission.release(job)
    book = FootprintBook(tmp_path / "state", StateFileProblems())

    async def reading_after_the_job() -> None:
        await trio.sleep(0.5)
        state.record_observation(
            Observation("gpu0", trio.current_time(), 24_000 * MIB, 14_000 * MIB)
        )

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reading_after_the_job)
        fell = await admission.measured_fall(job, timeout_s=5)
    assert fell == {"gpu0": 6000}
    book.measure("llama", "other", "gpu0", fell["gpu0"])
    hint = await book.hint(on_gpu(), "other")
    assert hint == FootprintHint({"gpu0": 6000}, "learned", "measured on earlier loads")
    # Kept across restarts.
    again = FootprintBook(tmp_path / "state", StateFileProblems())
    assert again.learned.get("llama", "other") == {"gpu0": 6000}


async def test_no_reading_after_the_job_measures_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    state = ready_state()
    admission = Admission(state, Ledger(state), DecisionLog(["llama"]))
    job = await admission.admit(on_gpu(), "other")
    assert isinstance(job, Reservation)
    admission.release(job)
    assert await admission.measured_fall(job, timeout_s=5) == {}


def test_a_small_fall_is_noise_not_a_load(tmp_path: Path) -> None:
    book = FootprintBook(tmp_path, StateFileProblems())
    book.measure("llama", "m", "gpu0", 100)
    assert book.learned.get("llama", "m") == {}


async def test_the_real_llama_servers_model_is_estimated_from_its_gguf(
    llama_url: str, tmp_path: Path
) -> None:
    text = one_upstream_config(llama_url, tmp_path, adapter="llamacpp", name="llama")
    config = parse_config(text)
    book = FootprintBook(tmp_path, StateFileProblems())
    hint = await book.hint(config.upstream[0], "gemma3-270m")
    assert hint is not None and hint.source == "estimated"
    # Gemma 3 270M Q4_K_M: about 240 MiB of weights plus KV, overhead and margin.
    assert 500 < hint.need_mib["ram"] < 2000
    assert "GGUF" in hint.detail and "2048 tokens" in hint.detail
