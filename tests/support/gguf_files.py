"""GGUF model files for footprint tests, written with the `gguf` package's GGUFWriter.

Each file has a real header (metadata and tensor table, as llama.cpp's converters write
them) and no real weights: the tensor data section is a sparse hole of the right length,
so a file that claims 4.9 GB of weights takes no disk space and a moment to write.
`with_data=True` writes real (zero) tensor data instead, for the path through
`write_tensors_to_file`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFWriter
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFEndian

Tensor = tuple[str, Sequence[int], GGMLQuantizationType]
Q = GGMLQuantizationType
ALIGNMENT = 32


def tensor_bytes(shape: Sequence[int], kind: GGMLQuantizationType) -> int:
    block, size = GGML_QUANT_SIZES[kind]
    return math.prod(shape) // block * size


def write_gguf(
    path: Path,
    arch: str,
    fields: Mapping[str, Any],
    tensors: Sequence[Tensor],
    *,
    with_data: bool = False,
    big_endian: bool = False,
    split_max_tensors: int = 0,
) -> Path:
    """Write a GGUF file (or a split set); returns the path of the (first) file.

    `fields` maps keys to values: int -> uint32, bool, float -> float32, str, and lists
    of ints, bools or strings -> arrays. Keys may be given without the "<arch>." prefix
    by starting them with "."; e.g. ".block_count".
    """
    endian = GGUFEndian.BIG if big_endian else GGUFEndian.LITTLE
    writer = GGUFWriter(path, arch, endianess=endian, split_max_tensors=split_max_tensors)
    for key, value in fields.items():
        _add(writer, f"{arch}{key}" if key.startswith(".") else key, value)
    for name, shape, kind in tensors:
        nbytes = tensor_bytes(shape, kind)
        if with_data:
            # GGUFWriter takes quantised data as bytes, its last dimension counted in bytes.
            block, size = GGML_QUANT_SIZES[kind]
            byte_shape = (*shape[:-1], shape[-1] // block * size)
            writer.add_tensor(name, np.zeros(byte_shape, dtype=np.uint8), raw_dtype=kind)
        else:
            writer.add_tensor_info(name, list(shape), np.dtype(np.float32), nbytes, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    if with_data:
        writer.write_tensors_to_file()
    else:
        writer.write_ti_data_to_file()
        assert writer.fout is not None
        for handle, part in zip(writer.fout, writer.tensors, strict=True):
            start = -(-handle.tell() // ALIGNMENT) * ALIGNMENT
            handle.truncate(
                start + sum(-(-t.nbytes // ALIGNMENT) * ALIGNMENT for t in part.values())
            )
    writer.close()
    if split_max_tensors:
        return writer.format_shard_names(path)[0]
    return path


def _add(writer: GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, list):
        writer.add_array(key, value)
    else:
        raise TypeError(f"no GGUF type for {key}={value!r}")


def layer_tensors(
    layers: int, embedding: int, q_dim: int, kv_dim: int, ffn: int, vocab: int
) -> list[Tensor]:
    """A plain decoder's tensors in F16 (sizes matter, not the quantisation)."""
    tensors: list[Tensor] = [
        ("token_embd.weight", (embedding, vocab), Q.F16),
        ("output_norm.weight", (embedding,), Q.F32),
    ]
    for i in range(layers):
        tensors += [
            (f"blk.{i}.attn_norm.weight", (embedding,), Q.F32),
            (f"blk.{i}.attn_q.weight", (embedding, q_dim), Q.F16),
            (f"blk.{i}.attn_k.weight", (embedding, kv_dim), Q.F16),
            (f"blk.{i}.attn_v.weight", (embedding, kv_dim), Q.F16),
            (f"blk.{i}.attn_output.weight", (q_dim, embedding), Q.F16),
            (f"blk.{i}.ffn_up.weight", (embedding, ffn), Q.F16),
            (f"blk.{i}.ffn_down.weight", (ffn, embedding), Q.F16),
        ]
    return tensors


def llama3_8b_q4_k_m_tensors() -> list[Tensor]:
    """Llama 3 8B's tensors with llama.cpp's Q4_K_M type choice (4.58 GiB, as it reports).

    Q4_K_M keeps Q6_K for the output, and for attn_v and ffn_down in the layers where
    llama.cpp's `use_more_bits` holds: the first and last eighth, and every third between.
    """
    layers, embedding, ffn, vocab = 32, 4096, 14336, 128256

    def more_bits(i: int) -> bool:
        return i < layers // 8 or i >= 7 * layers // 8 or (i - layers // 8) % 3 == 2

    tensors: list[Tensor] = [
        ("token_embd.weight", (embedding, vocab), Q.Q4_K),
        ("output.weight", (embedding, vocab), Q.Q6_K),
        ("output_norm.weight", (embedding,), Q.F32),
        ("rope_freqs.weight", (64,), Q.F32),
    ]
    for i in range(layers):
        wide = Q.Q6_K if more_bits(i) else Q.Q4_K
        tensors += [
            (f"blk.{i}.attn_norm.weight", (embedding,), Q.F32),
            (f"blk.{i}.attn_q.weight", (embedding, embedding), Q.Q4_K),
            (f"blk.{i}.attn_k.weight", (embedding, 1024), Q.Q4_K),
            (f"blk.{i}.attn_v.weight", (embedding, 1024), wide),
            (f"blk.{i}.attn_output.weight", (embedding, embedding), Q.Q4_K),
            (f"blk.{i}.ffn_norm.weight", (embedding,), Q.F32),
            (f"blk.{i}.ffn_gate.weight", (embedding, ffn), Q.Q4_K),
            (f"blk.{i}.ffn_up.weight", (embedding, ffn), Q.Q4_K),
            (f"blk.{i}.ffn_down.weight", (ffn, embedding), wide),
        ]
    return tensors


LLAMA3_8B_FIELDS: dict[str, Any] = {
    ".context_length": 8192,
    ".embedding_length": 4096,
    ".block_count": 32,
    ".feed_forward_length": 14336,
    ".attention.head_count": 32,
    ".attention.head_count_kv": 8,
    ".rope.dimension_count": 128,
    ".vocab_size": 128256,
    "general.file_type": 15,
}


def write_llama3_8b(path: Path) -> Path:
    """A header with Llama 3 8B's real geometry and Q4_K_M tensor table (sparse data)."""
    return write_gguf(path, "llama", LLAMA3_8B_FIELDS, llama3_8b_q4_k_m_tensors())
