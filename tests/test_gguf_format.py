"""The GGUF constants vacancyd keeps (vacancyd/footprint/gguf_format.py) are llama.cpp's.

The daemon no longer imports the `gguf` package (it brought numpy and more into every idle
daemon), so its copy of the format's numbers is checked here against the package the test
extra installs: a release that adds a tensor type or changes a block size fails here.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from vacancyd.footprint import gguf_format

gguf_constants = pytest.importorskip("gguf.constants")


def test_the_magic_alignment_and_value_types_are_the_packages() -> None:
    assert gguf_format.GGUF_MAGIC == gguf_constants.GGUF_MAGIC
    assert gguf_format.GGUF_DEFAULT_ALIGNMENT == gguf_constants.GGUF_DEFAULT_ALIGNMENT
    ours = {kind.name: kind.value for kind in gguf_format.GGUFValueType}
    theirs = {kind.name: kind.value for kind in gguf_constants.GGUFValueType}
    assert ours == theirs


def test_every_tensor_types_block_is_the_packages() -> None:
    theirs = {kind.value: tuple(sizes) for kind, sizes in gguf_constants.GGML_QUANT_SIZES.items()}
    assert theirs == gguf_format.TENSOR_BLOCKS


def test_the_daemon_imports_no_numpy_and_no_gguf() -> None:
    """What the service and the footprint reader import, in a fresh interpreter."""
    probe = (
        "import sys, vacancyd.service, vacancyd.footprint.gguf_reader, vacancyd.cli;"
        "heavy = sorted(m for m in ('gguf', 'numpy', 'yaml', 'requests', 'tqdm', 'litellm')"
        " if m in sys.modules); print(','.join(heavy))"
    )
    found = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert found.stdout.strip() == ""
