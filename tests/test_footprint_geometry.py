"""Geometry and KV cache sizes, one GGUF file per kind of model, each against a hand count.

Every file is written with the `gguf` package's GGUFWriter, read back by our reader, and
its KV cache computed by `estimate`; the expected bytes are spelled out as the product
that defines them (layers x KV heads x (key + value) x cells x bytes), so a reader can
check the arithmetic against the model's published shape.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.gguf_files import LLAMA3_8B_FIELDS, layer_tensors, write_gguf, write_llama3_8b
from vacancyd.footprint.architectures import SLIDING_RULES
from vacancyd.footprint.estimate import MIB, estimate
from vacancyd.footprint.geometry import (
    Geometry,
    GeometryError,
    geometry_from_gguf_fields,
    geometry_from_ollama_model_info,
)
from vacancyd.footprint.gguf_reader import read_geometry


def kv_mib(size_bytes: int) -> int:
    return -(-size_bytes // MIB)


def test_plain_gqa_llama_caches_only_the_kv_heads(tmp_path: Path) -> None:
    # 8 layers, 16 query heads sharing 4 KV heads, head size 1024 / 16 = 64 (no key_length
    # keys: derived as llama.cpp does).
    fields = {
        ".block_count": 8,
        ".embedding_length": 1024,
        ".attention.head_count": 16,
        ".attention.head_count_kv": 4,
        ".context_length": 16384,
    }
    path = write_gguf(
        tmp_path / "llama.gguf", "llama", fields, layer_tensors(8, 1024, 1024, 256, 2816, 32000)
    )
    geometry = read_geometry(path)
    assert (geometry.key_length, geometry.value_length) == (64, 64)
    assert geometry.full_attention_layer_count == 8
    assert geometry.context_length == 16384
    result = estimate(geometry, 4096)
    assert result.kv_cache_mib == kv_mib(8 * 4 * (64 + 64) * 4096 * 2)  # 32 MiB
    assert result.kv_cache_mib == 32
    assert result.recurrent_state_mib == 0


def test_llama3_8b_at_8k_is_one_gib_of_kv_and_its_real_weights(tmp_path: Path) -> None:
    geometry = read_geometry(write_llama3_8b(tmp_path / "Meta-Llama-3-8B.Q4_K_M.gguf"))
    assert geometry.weights_bytes == 4_912_898_304  # llama.cpp reports 4.58 GiB
    result = estimate(geometry, 8192)
    assert result.kv_cache_mib == kv_mib(32 * 8 * (128 + 128) * 8192 * 2) == 1024
    assert result.weights_mib == 4686


def test_mla_caches_the_latent_not_the_heads(tmp_path: Path) -> None:
    # DeepSeek-V3-like attention, 4 layers: converted with key_length_mla, llama.cpp caches
    # one latent of kv_lora_rank (512) + rope dims (64) per token and layer.
    fields = {
        ".block_count": 4,
        ".embedding_length": 2048,
        ".attention.head_count": 16,
        ".attention.head_count_kv": 1,
        ".attention.key_length": 576,
        ".attention.value_length": 512,
        ".attention.key_length_mla": 192,
        ".attention.value_length_mla": 128,
        ".attention.kv_lora_rank": 512,
        ".attention.q_lora_rank": 1536,
        ".rope.dimension_count": 64,
    }
    path = write_gguf(
        tmp_path / "ds.gguf", "deepseek2", fields, layer_tensors(4, 2048, 2048, 576, 4096, 1000)
    )
    geometry = read_geometry(path)
    assert geometry.is_mla
    assert (geometry.kv_lora_rank, geometry.rope_dimension_count) == (512, 64)
    result = estimate(geometry, 8192)
    assert result.kv_cache_mib == kv_mib(4 * (512 + 64) * 8192 * 2) == 36
    assert "latent rank 512" in result.explain()


def test_mla_without_key_length_mla_is_sized_as_full_attention(tmp_path: Path) -> None:
    # Older conversions have no key_length_mla; llama.cpp runs them as plain multi-head
    # attention over head_count_kv heads of 192 + 128.
    fields = {
        ".block_count": 4,
        ".embedding_length": 2048,
        ".attention.head_count": 16,
        ".attention.head_count_kv": 16,
        ".attention.key_length": 192,
        ".attention.value_length": 128,
        ".attention.kv_lora_rank": 512,
        ".rope.dimension_count": 64,
    }
    path = write_gguf(
        tmp_path / "old.gguf", "deepseek2", fields, layer_tensors(4, 64, 64, 64, 64, 8)
    )
    geometry = read_geometry(path)
    assert not geometry.is_mla
    assert estimate(geometry, 8192).kv_cache_mib == kv_mib(4 * 16 * (192 + 128) * 8192 * 2)
    assert any("key_length_mla" in note for note in geometry.notes)


QWEN3NEXT_FIELDS: dict[str, Any] = {
    ".block_count": 8,
    ".embedding_length": 2048,
    ".attention.head_count": 16,
    ".attention.head_count_kv": 2,
    ".attention.key_length": 256,
    ".attention.value_length": 256,
    ".full_attention_interval": 4,
    ".ssm.conv_kernel": 4,
    ".ssm.inner_size": 4096,
    ".ssm.state_size": 128,
    ".ssm.group_count": 16,
    ".ssm.time_step_rank": 32,
}
# One linear-attention layer's state for one sequence, f32: the conv rows
# (kernel - 1) x (inner + 2 x groups x state) and the delta-rule state state x inner.
QWEN3NEXT_STATE_BYTES = ((4 - 1) * (4096 + 2 * 16 * 128) + 128 * 4096) * 4


def test_hybrid_linear_attention_caches_only_full_attention_layers(tmp_path: Path) -> None:
    path = write_gguf(
        tmp_path / "q3n.gguf", "qwen3next", QWEN3NEXT_FIELDS, layer_tensors(8, 64, 64, 64, 64, 8)
    )
    geometry = read_geometry(path)
    # Every 4th layer (3 and 7) is full attention; the other 6 are recurrent.
    assert geometry.attention_layers == (False, False, False, True) * 2
    assert geometry.recurrent_layer_count == 6
    assert geometry.recurrent_state_bytes == QWEN3NEXT_STATE_BYTES
    result = estimate(geometry, 4096, parallel=2)
    assert result.kv_cache_mib == kv_mib(2 * 2 * (256 + 256) * 4096 * 2) == 16
    # The state is per slot and does not grow with the context.
    assert result.recurrent_state_mib == kv_mib(6 * QWEN3NEXT_STATE_BYTES * 2)
    assert estimate(geometry, 65536, parallel=2).recurrent_state_mib == result.recurrent_state_mib


def test_hybrid_interval_defaults_to_llama_cpps_when_the_file_omits_it(tmp_path: Path) -> None:
    fields = {k: v for k, v in QWEN3NEXT_FIELDS.items() if k != ".full_attention_interval"}
    path = write_gguf(tmp_path / "q.gguf", "qwen3next", fields, layer_tensors(8, 64, 64, 64, 64, 8))
    geometry = read_geometry(path)
    assert geometry.attention_layers == (False, False, False, True) * 2
    assert any("default" in note for note in geometry.notes)


def test_jamba_style_hybrid_marks_recurrent_layers_by_zero_kv_heads(tmp_path: Path) -> None:
    fields = {
        ".block_count": 8,
        ".embedding_length": 1024,
        ".attention.head_count": 8,
        ".attention.head_count_kv": [0, 0, 0, 4, 0, 0, 0, 4],
        ".ssm.conv_kernel": 4,
        ".ssm.inner_size": 2048,
        ".ssm.state_size": 16,
        ".ssm.time_step_rank": 64,
    }
    path = write_gguf(tmp_path / "j.gguf", "jamba", fields, layer_tensors(8, 64, 64, 64, 64, 8))
    geometry = read_geometry(path)
    assert geometry.head_count_kv == (0, 0, 0, 4, 0, 0, 0, 4)
    assert geometry.recurrent_layers == (True, True, True, False) * 2
    mamba_state = ((4 - 1) * 2048 + 16 * 2048) * 4
    assert geometry.recurrent_state_bytes == mamba_state
    result = estimate(geometry, 8192)
    assert result.kv_cache_mib == kv_mib(2 * 4 * (128 + 128) * 8192 * 2) == 32
    assert result.recurrent_state_mib == kv_mib(6 * mamba_state)


def test_pure_mamba_has_no_kv_cache() -> None:
    fields = {
        "general.architecture": "mamba",
        "mamba.block_count": 24,
        "mamba.embedding_length": 768,
        "mamba.ssm.conv_kernel": 4,
        "mamba.ssm.inner_size": 1536,
        "mamba.ssm.state_size": 16,
        "mamba.ssm.time_step_rank": 48,
    }
    geometry = geometry_from_gguf_fields(fields, 1)
    result = estimate(geometry, 100_000)
    assert result.kv_cache_mib == 0
    assert geometry.recurrent_layer_count == 24
    assert result.recurrent_state_mib == kv_mib(24 * (3 * 1536 + 16 * 1536) * 4)


GEMMA3_FIELDS: dict[str, Any] = {
    ".block_count": 12,
    ".embedding_length": 1152,
    ".attention.head_count": 8,
    ".attention.head_count_kv": 4,
    ".attention.key_length": 256,
    ".attention.value_length": 256,
    ".attention.sliding_window": 1024,
    ".context_length": 32768,
}


def test_gemma3_sliding_layers_cache_no_more_than_the_window(tmp_path: Path) -> None:
    path = write_gguf(
        tmp_path / "g3.gguf", "gemma3", GEMMA3_FIELDS, layer_tensors(12, 64, 64, 64, 64, 8)
    )
    geometry = read_geometry(path)
    # Gemma 3 interleaves 5 sliding layers with 1 global: layers 5 and 11 are global.
    assert [i for i, s in enumerate(geometry.sliding_layers) if not s] == [5, 11]
    assert geometry.sliding_window == 1024
    result = estimate(geometry, 8192)
    # Global layers hold 8192 cells; sliding ones the window plus one micro-batch (512),
    # rounded up to 256: 1536.
    full = 2 * 4 * (256 + 256) * 8192 * 2
    sliding = 10 * 4 * (256 + 256) * 1536 * 2
    assert result.kv_cache_mib == kv_mib(full + sliding) == 124
    assert (result.full_cells, result.sliding_cells) == (8192, 1536)
    # Below the window every layer holds the whole (padded) context.
    assert estimate(geometry, 1000).kv_cache_mib == kv_mib(12 * 4 * 512 * 1024 * 2)


def test_a_pattern_in_the_file_overrides_the_architectures_default(tmp_path: Path) -> None:
    fields = dict(GEMMA3_FIELDS, **{".attention.sliding_window_pattern": 3})
    geometry = read_geometry(
        write_gguf(tmp_path / "a.gguf", "gemma3", fields, layer_tensors(12, 64, 64, 64, 64, 8))
    )
    assert [i for i, s in enumerate(geometry.sliding_layers) if not s] == [2, 5, 8, 11]
    per_layer = [i % 2 == 0 for i in range(12)]
    fields = dict(GEMMA3_FIELDS, **{".attention.sliding_window_pattern": per_layer})
    geometry = read_geometry(
        write_gguf(tmp_path / "b.gguf", "gemma3", fields, layer_tensors(12, 64, 64, 64, 64, 8))
    )
    assert list(geometry.sliding_layers) == per_layer


def test_an_unknown_architecture_with_a_window_is_charged_the_whole_context() -> None:
    fields = {
        "general.architecture": "newthing",
        "newthing.block_count": 4,
        "newthing.attention.head_count": 4,
        "newthing.attention.head_count_kv": 4,
        "newthing.attention.key_length": 64,
        "newthing.attention.value_length": 64,
        "newthing.attention.sliding_window": 128,
    }
    geometry = geometry_from_gguf_fields(fields, 0)
    assert not any(geometry.sliding_layers)
    assert any("no layer pattern" in note for note in geometry.notes)


def test_phi3s_window_is_ignored_as_llama_cpp_ignores_it() -> None:
    fields = {
        "general.architecture": "phi3",
        "phi3.block_count": 4,
        "phi3.embedding_length": 256,
        "phi3.attention.head_count": 4,
        "phi3.attention.sliding_window": 2047,
    }
    geometry = geometry_from_gguf_fields(fields, 0)
    assert geometry.sliding_window is None
    assert estimate(geometry, 8192).kv_cache_mib == kv_mib(4 * 4 * 128 * 8192 * 2)


@pytest.mark.parametrize(
    ("arch", "global_layers"),
    [
        ("gemma3", [5, 11]),
        ("gemma2", [1, 3, 5, 7, 9, 11]),
        ("cohere2", [3, 7, 11]),
        ("gpt-oss", [1, 3, 5, 7, 9, 11]),
        ("cohere2moe", [0, 4, 8]),  # dense first
    ],
)
def test_sliding_rules_mirror_llama_cpps_set_swa_pattern(
    arch: str, global_layers: list[int]
) -> None:
    rule = SLIDING_RULES[arch]
    assert [i for i in range(12) if not rule.is_sliding(i)] == global_layers


def test_per_layer_head_counts_must_match_the_layer_count() -> None:
    fields = {
        "general.architecture": "llama",
        "llama.block_count": 4,
        "llama.attention.head_count": 8,
        "llama.attention.head_count_kv": [2, 2, 2],
        "llama.attention.key_length": 64,
        "llama.attention.value_length": 64,
    }
    with pytest.raises(GeometryError, match="head_count_kv has 3 entries for 4 layers"):
        geometry_from_gguf_fields(fields, 0)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"general.architecture": None}, "general.architecture"),
        ({"llama.block_count": None}, "block_count"),
        ({"llama.block_count": -3}, "block_count"),
        ({"llama.attention.head_count": "many"}, "head_count"),
        ({"llama.attention.head_count": None}, "head_count"),
    ],
)
def test_unusable_metadata_is_refused_with_the_key(change: dict[str, Any], message: str) -> None:
    fields: dict[str, Any] = {
        "general.architecture": "llama",
        "llama.block_count": 4,
        "llama.embedding_length": 512,
        "llama.attention.head_count": 8,
    }
    fields.update(change)
    with pytest.raises(GeometryError, match=message):
        geometry_from_gguf_fields({k: v for k, v in fields.items() if v is not None}, 0)


# What Ollama's /api/show returns for llama3.1:8b (Q4_K_M), trimmed: the GGUF table with
# arrays longer than 5 replaced by [] (no verbose), general.name removed.
OLLAMA_LLAMA31_8B: dict[str, Any] = {
    "general.architecture": "llama",
    "general.basename": "Meta-Llama-3.1",
    "general.file_type": 15,
    "general.parameter_count": 8030261248,
    "general.quantization_version": 2,
    "llama.attention.head_count": 32,
    "llama.attention.head_count_kv": 8,
    "llama.attention.layer_norm_rms_epsilon": 0.00001,
    "llama.block_count": 32,
    "llama.context_length": 131072,
    "llama.embedding_length": 4096,
    "llama.feed_forward_length": 14336,
    "llama.rope.dimension_count": 128,
    "llama.rope.freq_base": 500000,
    "llama.vocab_size": 128256,
    "tokenizer.ggml.bos_token_id": 128000,
    "tokenizer.ggml.merges": [],
    "tokenizer.ggml.model": "gpt2",
    "tokenizer.ggml.token_type": [],
    "tokenizer.ggml.tokens": [],
}


def test_ollama_model_info_uses_the_same_keys_as_gguf(tmp_path: Path) -> None:
    from_ollama = geometry_from_ollama_model_info(OLLAMA_LLAMA31_8B, 4_920_753_328)
    from_file = read_geometry(write_llama3_8b(tmp_path / "l.gguf"))
    assert from_ollama.weights_bytes == 4_920_753_328
    assert from_ollama.vocab_size == LLAMA3_8B_FIELDS[".vocab_size"]
    assert estimate(from_ollama, 8192).kv_cache_mib == estimate(from_file, 8192).kv_cache_mib
    assert _kv_shape(from_ollama) == _kv_shape(from_file)


def _kv_shape(geometry: Geometry) -> tuple[Any, ...]:
    return (
        geometry.architecture,
        geometry.block_count,
        geometry.head_count_kv,
        geometry.key_length,
        geometry.value_length,
        geometry.sliding_layers,
        geometry.attention_layers,
    )


def test_ollama_without_a_size_estimates_weights_from_parameters() -> None:
    geometry = geometry_from_ollama_model_info(OLLAMA_LLAMA31_8B, None)
    # Q4_K_M (file type 15): 0.625 bytes per weight, rounded up from its ~4.85 bits.
    assert geometry.weights_bytes == 5_018_913_280
    assert any("parameter_count" in note for note in geometry.notes)
    with pytest.raises(GeometryError, match="parameter_count"):
        geometry_from_ollama_model_info(
            {k: v for k, v in OLLAMA_LLAMA31_8B.items() if k != "general.parameter_count"}, None
        )


def test_ollama_elided_arrays_fall_back_to_the_conservative_default() -> None:
    info = dict(OLLAMA_LLAMA31_8B, **{"llama.attention.head_count_kv": []})
    geometry = geometry_from_ollama_model_info(info, 1)
    # Without the per-layer KV heads every layer is charged all 32 heads.
    assert geometry.head_count_kv == 32
    assert any("elided" in note for note in geometry.notes)


def test_ollama_cloud_models_have_no_geometry() -> None:
    with pytest.raises(GeometryError, match="block_count"):
        geometry_from_ollama_model_info(
            {"general.architecture": "gptoss", "gptoss.context_length": 131072}, 1
        )
