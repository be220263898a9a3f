"""The GGUF format's constants the header walk needs, kept here rather than imported.

They are llama.cpp's (its `gguf` package spells them in `gguf.constants`), but importing
that package for a few numbers pulled numpy, PyYAML, requests and tqdm into the daemon:
about 19.5 MiB of memory and 160 ms of start-up for every idle daemon. They change only
when llama.cpp adds a tensor type; tests/test_gguf_format.py compares every one with the
`gguf` package of the test extra, so a new release that adds or changes one fails there
first. A tensor type missing here is not an error: its size is counted from the file's
data section instead (gguf_reader.py).
"""

from __future__ import annotations

import enum
from typing import Final

# "GGUF" read as a little-endian uint32.
GGUF_MAGIC: Final = 0x46554747
GGUF_DEFAULT_ALIGNMENT: Final = 32


class GGUFValueType(enum.IntEnum):
    """The type code of a metadata value."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


# Tensor type code -> (elements per block, bytes per block).
TENSOR_BLOCKS: Final[dict[int, tuple[int, int]]] = {
    0: (1, 4),  # F32
    1: (1, 2),  # F16
    2: (32, 18),  # Q4_0
    3: (32, 20),  # Q4_1
    6: (32, 22),  # Q5_0
    7: (32, 24),  # Q5_1
    8: (32, 34),  # Q8_0
    9: (32, 40),  # Q8_1
    10: (256, 84),  # Q2_K
    11: (256, 110),  # Q3_K
    12: (256, 144),  # Q4_K
    13: (256, 176),  # Q5_K
    14: (256, 210),  # Q6_K
    15: (256, 292),  # Q8_K
    16: (256, 66),  # IQ2_XXS
    17: (256, 74),  # IQ2_XS
    18: (256, 98),  # IQ3_XXS
    19: (256, 50),  # IQ1_S
    20: (32, 18),  # IQ4_NL
    21: (256, 110),  # IQ3_S
    22: (256, 82),  # IQ2_S
    23: (256, 136),  # IQ4_XS
    24: (1, 1),  # I8
    25: (1, 2),  # I16
    26: (1, 4),  # I32
    27: (1, 8),  # I64
    28: (1, 8),  # F64
    29: (256, 56),  # IQ1_M
    30: (1, 2),  # BF16
    34: (256, 54),  # TQ1_0
    35: (256, 66),  # TQ2_0
    39: (32, 17),  # MXFP4
    40: (64, 36),  # NVFP4
    41: (128, 18),  # Q1_0
}
