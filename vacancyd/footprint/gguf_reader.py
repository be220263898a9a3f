"""Read a GGUF model file's header: its metadata and its tensors' sizes, never their data.

Blocking file I/O: the daemon calls `read_geometry` through `trio.to_thread.run_sync`
under a deadline of its own; the CLI calls it directly.

The format's constants (the magic number, the value-type codes, the default alignment and
the block sizes of every tensor type) are llama.cpp's, kept in gguf_format.py so that the
daemon does not import the `gguf` package. The walk over the header is ours, for two
reasons measured on the Gemma 3 270M fixture: `gguf.GGUFReader` builds a numpy object for
every element of every array, so the 262,144-entry token list took 12.7 s and about
700 MB of memory to read; and it trusts every length it reads. This walk keeps only
scalars and short arrays (per-layer values), steps over long arrays by their lengths, and
stops with a `GGUFError` naming the file and the problem at the first length that cannot
fit: the header may not be larger than MAX_HEADER_BYTES, counts and strings are bounded,
and a file shorter than its own tensor table says is refused. Tests compare what it reads
with `gguf.GGUFReader`.

A model split into several files (`<name>-00001-of-00003.gguf`, as llama.cpp writes and
loads them) is read from its first file; the weights of all its parts are summed.
"""

from __future__ import annotations

import math
import os
import re
import stat
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any, Final

import attrs

from vacancyd.footprint.geometry import Geometry, geometry_from_gguf_fields
from vacancyd.footprint.gguf_format import (
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    TENSOR_BLOCKS,
    GGUFValueType,
)

MAX_HEADER_BYTES: Final = 128 * 1024 * 1024
MAX_KV_COUNT: Final = 65_536
MAX_TENSOR_COUNT: Final = 1_000_000
MAX_STRING_BYTES: Final = 16 * 1024 * 1024
MAX_KEPT_ARRAY: Final = 65_536  # longer arrays are stepped over, their length kept
MAX_DIMS: Final = 8
MAX_SPLITS: Final = 1000
SUPPORTED_VERSIONS: Final = (2, 3)

_SCALARS: Final[Mapping[GGUFValueType, str]] = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}
_SPLIT_NAME: Final = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


class GGUFError(Exception):
    """A file that is not a GGUF model we can read; `reason` says why, for a person."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


@attrs.frozen
class SkippedArray:
    """An array too long to keep (a tokenizer's vocabulary): its type and length only."""

    item_type: str
    length: int

    def __len__(self) -> int:
        return self.length


@attrs.frozen
class GGUFHeader:
    """What a GGUF header says. `tensor_bytes` is None when a tensor type is unknown to
    here (gguf_format.py); `weights_bytes` then falls back to the data section."""

    path: Path
    version: int
    fields: Mapping[str, Any]
    tensor_count: int
    tensor_bytes: int | None
    data_offset: int
    file_size: int

    @property
    def weights_bytes(self) -> int:
        if self.tensor_bytes is not None:
            return self.tensor_bytes
        return max(self.file_size - self.data_offset, 0)


def read_geometry(path: str | os.PathLike[str]) -> Geometry:
    """The geometry of the model in a GGUF file (all parts, for a split model).

    Raises GGUFError for a file that cannot be read as GGUF, GeometryError for one whose
    metadata does not describe a model we can size, OSError for a file that cannot be
    opened at all.
    """
    header = read_gguf_header(path)
    weights = header.weights_bytes
    for part in _other_split_parts(header):
        weights += read_gguf_header(part).weights_bytes
    return geometry_from_gguf_fields(header.fields, weights)


def read_gguf_header(path: str | os.PathLike[str]) -> GGUFHeader:
    """Read one file's header (metadata and tensor table); see the module docstring."""
    where = Path(path)
    # O_NONBLOCK: a FIFO planted under the model's name must not block the open.
    fd = os.open(where, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0))
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise GGUFError(where, "is not a regular file")
    with os.fdopen(fd, "rb", buffering=1024 * 1024) as handle:
        return _Walk(handle, where, info.st_size).header()


def _other_split_parts(header: GGUFHeader) -> list[Path]:
    count = header.fields.get("split.count")
    if not isinstance(count, int) or count <= 1:
        return []
    match = _SPLIT_NAME.match(header.path.name)
    if count > MAX_SPLITS or match is None or int(match["no"]) != 1 or int(match["count"]) != count:
        raise GGUFError(
            header.path,
            f"is part of a {count}-part model; name its first part (<name>-00001-of-<count>.gguf)",
        )
    parts = [
        header.path.with_name(f"{match['prefix']}-{number:05d}-of-{count:05d}.gguf")
        for number in range(2, count + 1)
    ]
    missing = [p.name for p in parts if not p.exists()]
    if missing:
        raise GGUFError(header.path, f"parts of this split model are missing: {', '.join(missing)}")
    return parts


class _Walk:
    """One bounded pass over a header; every read is charged against MAX_HEADER_BYTES."""

    def __init__(self, handle: IO[bytes], path: Path, file_size: int) -> None:
        self.handle = handle
        self.path = path
        self.file_size = file_size
        self.used = 0
        self.order = "<"

    def fail(self, reason: str) -> GGUFError:
        return GGUFError(self.path, reason)

    def charge(self, count: int) -> None:
        self.used += count
        if self.used > MAX_HEADER_BYTES:
            raise self.fail(f"has a header larger than {MAX_HEADER_BYTES // (1024 * 1024)} MiB")
        if self.used > self.file_size:
            raise self.fail("ends inside its header (truncated or not a GGUF file)")

    def take(self, count: int) -> bytes:
        self.charge(count)
        data = self.handle.read(count)
        if len(data) != count:
            raise self.fail("ends inside its header (truncated)")
        return data

    def skip(self, count: int) -> None:
        self.charge(count)
        self.handle.seek(count, os.SEEK_CUR)

    def scalar(self, code: str) -> Any:
        size = struct.calcsize(code)
        return struct.unpack(self.order + code, self.take(size))[0]

    def header(self) -> GGUFHeader:
        if self.file_size < 24 or struct.unpack("<I", self.take(4))[0] != GGUF_MAGIC:
            raise self.fail("is not a GGUF file (no GGUF magic number)")
        version = struct.unpack("<I", self.take(4))[0]
        if version & 0xFFFF == 0:  # written on a machine of the other byte order
            self.order = ">"
            version = struct.unpack(">I", struct.pack("<I", version))[0]
        if version not in SUPPORTED_VERSIONS:
            raise self.fail(f"is GGUF version {version}; versions 2 and 3 are read")
        tensor_count, kv_count = self.scalar("Q"), self.scalar("Q")
        if kv_count > MAX_KV_COUNT or tensor_count > MAX_TENSOR_COUNT:
            raise self.fail(f"claims {kv_count} metadata keys and {tensor_count} tensors")
        fields = dict(self.field() for _ in range(kv_count))
        tensor_bytes, data_end = self.tensors(tensor_count)
        alignment = fields.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment % 8:
            raise self.fail(f"has an invalid general.alignment: {alignment!r}")
        data_offset = -(-self.used // alignment) * alignment
        if data_offset + data_end > self.file_size:
            raise self.fail(
                f"is shorter ({self.file_size} bytes) than its tensor table says "
                f"({data_offset + data_end} bytes): truncated"
            )
        return GGUFHeader(
            self.path, version, fields, tensor_count, tensor_bytes, data_offset, self.file_size
        )

    def string(self, keep: bool = True) -> str:
        length = self.scalar("Q")
        if length > MAX_STRING_BYTES:
            raise self.fail(f"has a string of {length} bytes")
        if not keep:
            self.skip(length)
            return ""
        return self.take(length).decode("utf-8", errors="replace")

    def value_type(self) -> GGUFValueType:
        code = self.scalar("I")
        try:
            return GGUFValueType(code)
        except ValueError:
            raise self.fail(f"has an unknown value type {code}") from None

    def field(self) -> tuple[str, Any]:
        key = self.string()
        return key, self.value(self.value_type(), depth=0)

    def value(self, kind: GGUFValueType, depth: int, keep: bool = True) -> Any:
        if kind is GGUFValueType.STRING:
            return self.string(keep)
        if kind is GGUFValueType.ARRAY:
            return self.array(depth)
        code = _SCALARS[kind]
        if not keep:
            self.skip(struct.calcsize(code))
            return None
        return self.scalar(code)

    def array(self, depth: int) -> Any:
        if depth > 1:
            raise self.fail("nests arrays more than two deep")
        kind = self.value_type()
        length = self.scalar("Q")
        smallest = 8 if kind in (GGUFValueType.STRING, GGUFValueType.ARRAY) else 1
        if length * smallest > MAX_HEADER_BYTES - self.used:
            raise self.fail(f"has an array of {length} items, larger than the header may be")
        if length <= MAX_KEPT_ARRAY:
            return [self.value(kind, depth + 1) for _ in range(length)]
        if kind in _SCALARS:
            self.skip(length * struct.calcsize(_SCALARS[kind]))
        else:
            for _ in range(length):
                self.value(kind, depth + 1, keep=False)
        return SkippedArray(kind.name.lower(), length)

    def tensors(self, count: int) -> tuple[int | None, int]:
        """Sum of the tensors' bytes (None if a type is unknown) and the data's extent."""
        total: int | None = 0
        end = 0
        for _ in range(count):
            name = self.string()
            dims = self.scalar("I")
            if dims > MAX_DIMS:
                raise self.fail(f"tensor {name!r} has {dims} dimensions")
            elements = math.prod(self.scalar("Q") for _ in range(dims))
            type_code, offset = self.scalar("I"), self.scalar("Q")
            size = _tensor_bytes(type_code, elements)
            if size is None:
                total = None
                continue
            if total is not None:
                total += size
            end = max(end, offset + size)
        return total, end


def _tensor_bytes(type_code: int, elements: int) -> int | None:
    known = TENSOR_BLOCKS.get(type_code)
    if known is None:
        return None
    block, block_bytes = known
    return -(-elements // block) * block_bytes
