"""The bounded GGUF header reader, checked against the `gguf` package's own GGUFReader.

Good files: what we read must equal what llama.cpp's maintained reader reads, field by
field and in total tensor bytes. Bad files: every one is refused with a GGUFError that
names the problem, quickly, without reading what the header claims.
"""

from __future__ import annotations

import os
import struct
import time
from pathlib import Path
from typing import Any

import pytest
from gguf import GGUFReader
from gguf.constants import GGUFValueType

from tests.support.gguf_files import Q, layer_tensors, write_gguf
from tests.support.llama import llama_paths
from vacancyd.footprint import gguf_reader
from vacancyd.footprint.gguf_reader import (
    GGUFError,
    SkippedArray,
    read_geometry,
    read_gguf_header,
)

FIELDS: dict[str, Any] = {
    ".block_count": 4,
    ".embedding_length": 256,
    ".attention.head_count": 4,
    ".attention.head_count_kv": [2, 2, 1, 1],
    ".attention.layer_norm_rms_epsilon": 1e-6,
    ".attention.sliding_window_pattern": [True, False, True, False],
    "general.name": "tiny ünïcode model",
    "tokenizer.ggml.tokens": ["<s>", "</s>", "a", "b"],
    "tokenizer.ggml.add_bos_token": True,
}


def write_tiny(path: Path, **options: Any) -> Path:
    return write_gguf(path, "llama", FIELDS, layer_tensors(4, 256, 256, 128, 512, 64), **options)


def gguf_package_view(path: Path) -> tuple[dict[str, Any], int]:
    reader = GGUFReader(path)
    fields = {
        name: field.contents()
        for name, field in reader.fields.items()
        if not name.startswith("GGUF.")
    }
    return fields, sum(int(t.n_bytes) for t in reader.tensors)


@pytest.mark.parametrize(
    "options", [{}, {"with_data": True}, {"big_endian": True}], ids=["sparse", "data", "big-endian"]
)
def test_reads_what_the_gguf_package_reads(tmp_path: Path, options: dict[str, Any]) -> None:
    path = write_tiny(tmp_path / "tiny.gguf", **options)
    header = read_gguf_header(path)
    fields, tensor_bytes = gguf_package_view(path)
    assert header.tensor_bytes == tensor_bytes
    assert set(header.fields) == set(fields)
    for key, value in fields.items():
        ours = header.fields[key]
        if isinstance(value, float):
            assert ours == pytest.approx(value), key
        else:
            assert ours == value, key


def test_long_arrays_are_stepped_over_but_their_length_kept(tmp_path: Path) -> None:
    tokens = [f"t{i}" for i in range(gguf_reader.MAX_KEPT_ARRAY + 7)]
    fields = dict(
        FIELDS, **{"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": [0.5] * 70_000}
    )
    path = write_gguf(tmp_path / "v.gguf", "llama", fields, layer_tensors(4, 64, 64, 64, 64, 8))
    header = read_gguf_header(path)
    assert header.fields["tokenizer.ggml.tokens"] == SkippedArray("string", len(tokens))
    assert len(header.fields["tokenizer.ggml.scores"]) == 70_000
    assert read_geometry(path).vocab_size == len(tokens)
    # What follows the skipped arrays is still read right.
    assert header.fields["tokenizer.ggml.add_bos_token"] is True


def test_a_split_model_sums_the_weights_of_every_part(tmp_path: Path) -> None:
    tensors = layer_tensors(4, 256, 256, 128, 512, 64)
    first = write_gguf(tmp_path / "big.gguf", "llama", FIELDS, tensors, split_max_tensors=10)
    assert first.name == "big-00001-of-00003.gguf"
    whole = write_tiny(tmp_path / "whole.gguf")
    assert read_geometry(first).weights_bytes == read_gguf_header(whole).tensor_bytes
    with pytest.raises(GGUFError, match="first part"):
        read_geometry(tmp_path / "big-00002-of-00003.gguf")
    (tmp_path / "big-00003-of-00003.gguf").unlink()
    with pytest.raises(GGUFError, match="missing: big-00003-of-00003"):
        read_geometry(first)


def test_the_real_gemma_fixture() -> None:
    _, model = llama_paths()
    started = time.perf_counter()
    geometry = read_geometry(model)
    took = time.perf_counter() - started
    assert (geometry.architecture, geometry.block_count, geometry.sliding_window) == (
        "gemma3",
        18,
        512,
    )
    assert (geometry.head_count, geometry.head_count_kv, geometry.key_length) == (4, 1, 256)
    assert geometry.vocab_size == 262_144
    # llama-server logs "CPU_Mapped model buffer size = 235.16 MiB" for this file.
    assert geometry.weights_bytes == 246_587_904
    # gguf.GGUFReader takes over ten seconds on this header; the walk must not.
    assert took < 5.0


def header_bytes(tensor_count: int, kv_count: int, version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, tensor_count, kv_count)


def key(name: str) -> bytes:
    return struct.pack("<Q", len(name)) + name.encode()


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"PK\x03\x04" + b"\x00" * 60, "no GGUF magic"),
        (b"GGUF", "no GGUF magic"),
        (header_bytes(0, 1, version=1), "version 1"),
        (header_bytes(0, 10**9), "metadata keys"),
        (header_bytes(10**9, 0), "tensors"),
        (header_bytes(0, 1) + key("a") + struct.pack("<I", 99), "unknown value type 99"),
        (
            header_bytes(0, 1) + key("a") + struct.pack("<IIQ", 9, 4, 10**15),
            "array of 1000000000000000 items",
        ),
        (
            header_bytes(0, 1) + key("a") + struct.pack("<IQ", 8, 10**12),
            "string of 1000000000000 bytes",
        ),
        (
            header_bytes(0, 2) + key("a") + struct.pack("<II", 4, 7) + struct.pack("<Q", 1000),
            "ends inside its header",
        ),
        (
            header_bytes(0, 1) + key("a") + struct.pack("<IIQ", 9, 9, 1) + struct.pack("<IQ", 9, 1)
            + struct.pack("<IQ", 9, 0),
            "nests arrays",
        ),
    ],
    ids=[
        "not-gguf", "too-short", "version", "kv-count", "tensor-count", "value-type",
        "array-length", "string-length", "truncated", "nested-arrays",
    ],
)  # fmt: skip
def test_malformed_headers_are_refused_with_a_reason(
    tmp_path: Path, content: bytes, reason: str
) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(content + b"\x00" * 16)
    started = time.perf_counter()
    with pytest.raises(GGUFError, match=reason) as caught:
        read_gguf_header(path)
    assert time.perf_counter() - started < 1.0
    assert caught.value.path == path


def test_a_file_shorter_than_its_tensor_table_is_refused(tmp_path: Path) -> None:
    path = write_tiny(tmp_path / "t.gguf")
    with path.open("r+b") as handle:
        handle.truncate(path.stat().st_size - 4096)
    with pytest.raises(GGUFError, match="truncated"):
        read_gguf_header(path)


def test_a_header_over_the_cap_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_tiny(tmp_path / "t.gguf")
    monkeypatch.setattr(gguf_reader, "MAX_HEADER_BYTES", 200)
    with pytest.raises(GGUFError, match="header larger than"):
        read_gguf_header(path)


def test_only_regular_files_are_read(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.gguf"
    os.mkfifo(fifo)
    with pytest.raises(GGUFError, match="not a regular file"):
        read_gguf_header(fifo)
    with pytest.raises(OSError):
        read_gguf_header(tmp_path / "missing.gguf")


def test_an_unknown_tensor_type_falls_back_to_the_data_section(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "u.gguf", "llama", FIELDS, [("w", (64, 64), Q.F16)])
    raw = bytearray(path.read_bytes())
    type_at = raw.rindex(struct.pack("<I", Q.F16.value) + struct.pack("<Q", 0))
    raw[type_at : type_at + 4] = struct.pack("<I", 250)
    path.write_bytes(bytes(raw))
    header = read_gguf_header(path)
    assert header.tensor_bytes is None
    assert header.weights_bytes == header.file_size - header.data_offset


def test_value_types_come_from_the_gguf_package() -> None:
    # The walk's scalar table covers every scalar type the format defines.
    scalar_types = set(GGUFValueType) - {GGUFValueType.STRING, GGUFValueType.ARRAY}
    assert set(gguf_reader._SCALARS) == scalar_types
