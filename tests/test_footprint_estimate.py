"""The estimate's arithmetic and rules, and the emergency floor, as plain tables."""

from __future__ import annotations

from typing import Any

import pytest

from vacancyd.footprint.estimate import (
    CACHE_TYPE_BYTES,
    GPU_RUNTIME_MIB,
    HOST_RUNTIME_MIB,
    MIB,
    estimate,
    kv_bytes_per_element,
)
from vacancyd.footprint.geometry import Geometry, geometry_from_gguf_fields

GIB = 1024 * MIB


def llama(weights_bytes: int = 4 * GIB, **extra: Any) -> Geometry:
    fields: dict[str, Any] = {
        "general.architecture": "llama",
        "llama.block_count": 32,
        "llama.embedding_length": 4096,
        "llama.attention.head_count": 32,
        "llama.attention.head_count_kv": 8,
    }
    fields.update({f"llama.{k}": v for k, v in extra.items()})
    return geometry_from_gguf_fields(fields, weights_bytes)


def test_parts_follow_the_documented_rule_and_total_exactly() -> None:
    result = estimate(llama(), 8192)
    assert result.weights_mib == 4096
    assert result.kv_cache_mib == 1024  # 32 x 8 x 256 x 8192 x 2 bytes
    # 512 MiB runtime (a GPU) + 10 % of the weights for compute buffers.
    assert result.overhead_mib == GPU_RUNTIME_MIB + 410
    subtotal = 4096 + 1024 + 0 + 922
    assert result.margin_mib == -(-subtotal * 10 // 100)
    assert result.total_mib == subtotal + result.margin_mib == 6647


def test_host_memory_has_the_larger_runtime_base() -> None:
    result = estimate(llama(), 8192, runtime_mib=HOST_RUNTIME_MIB)
    assert result.overhead_mib == HOST_RUNTIME_MIB + 410


def test_margin_and_compute_share_are_the_callers_to_set() -> None:
    result = estimate(llama(), 8192, margin_pct=0, compute_share_pct=0, runtime_mib=0)
    assert (result.overhead_mib, result.margin_mib) == (0, 0)
    assert result.total_mib == 4096 + 1024


@pytest.mark.parametrize(
    ("cache_type", "kv_mib"),
    [("f16", 1024), ("f32", 2048), ("q8_0", 544), ("q4_0", 288)],
)
def test_quantised_caches_take_their_block_size(cache_type: str, kv_mib: int) -> None:
    # q8_0 stores 32 elements in 34 bytes; q4_0 in 18.
    result = estimate(llama(), 8192, kv_bytes_per_element=kv_bytes_per_element(cache_type))
    assert result.kv_cache_mib == kv_mib


def test_cache_type_names_cover_llama_cpps_cache_types() -> None:
    assert {"f16", "q8_0", "q4_0"} <= set(CACHE_TYPE_BYTES)
    with pytest.raises(KeyError):
        kv_bytes_per_element("q3_k")


def test_parallel_slots_share_the_context_and_round_per_slot() -> None:
    geometry = llama()
    # 3 slots of ceil(8192 / 3) = 2731 cells, each rounded up to 2816.
    result = estimate(geometry, 8192, parallel=3)
    assert result.full_cells == 3 * 2816
    # A unified cache rounds once.
    assert estimate(geometry, 8192, parallel=3, unified_kv=True).full_cells == 8192


def test_sliding_window_with_parallel_slots_and_a_unified_cache() -> None:
    fields = {
        "general.architecture": "gemma3",
        "gemma3.block_count": 6,
        "gemma3.attention.head_count": 4,
        "gemma3.attention.head_count_kv": 1,
        "gemma3.attention.key_length": 256,
        "gemma3.attention.value_length": 256,
        "gemma3.attention.sliding_window": 512,
    }
    geometry = geometry_from_gguf_fields(fields, 0)
    # Per slot: min(4096 / 4, 512 + 512) = 1024 cells; unified: min(4096, 512 x 4 + 512).
    assert estimate(geometry, 4096, parallel=4).sliding_cells == 4 * 1024
    assert estimate(geometry, 4096, parallel=4, unified_kv=True).sliding_cells == 2560


def test_explain_lists_every_part_and_the_notes() -> None:
    text = estimate(llama(), 8192).explain()
    for part in ("weights", "KV cache", "recurrent state", "overhead", "margin", "total"):
        assert part in text
    assert "32 full-attention layers x 8192 cells" in text
    assert "512 MiB runtime + 10% of weights" in text
    assert "6647 MiB" in text
    noted = geometry_from_gguf_fields(
        {
            "general.architecture": "qwen3next",
            "qwen3next.block_count": 4,
            "qwen3next.attention.head_count": 4,
            "qwen3next.attention.key_length": 64,
            "qwen3next.attention.value_length": 64,
        },
        0,
    )
    assert "note: full attention every 4 layers" in estimate(noted, 4096).explain()


def test_as_dict_carries_the_parts_and_the_total() -> None:
    document = estimate(llama(), 8192).as_dict()
    parts = ("weights_mib", "kv_cache_mib", "recurrent_state_mib", "overhead_mib", "margin_mib")
    assert document["total_mib"] == sum(document[p] for p in parts)


@pytest.mark.parametrize(
    "arguments",
    [{"context_tokens": 0}, {"parallel": 0}, {"kv_bytes_per_element": 0}, {"margin_pct": -1}],
)
def test_impossible_arguments_are_refused(arguments: dict[str, Any]) -> None:
    call: dict[str, Any] = {"context_tokens": 4096, **arguments}
    with pytest.raises(ValueError):
        estimate(llama(), **call)
