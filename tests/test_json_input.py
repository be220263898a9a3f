"""The one reader for outside JSON (vacancyd/json_input.py): every failure is JsonRejected
with words of its own, never a RecursionError, never the document quoted back."""

from __future__ import annotations

import contextlib
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vacancyd.json_input import JsonRejected, nested_deeper_than, parse_json

LIMIT = 1024 * 1024
SECRET = "the borrower's secret prompt"


@pytest.mark.parametrize(
    ("document", "why"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "nested deeper"),
        (b'{"a":' * 5000 + b"1" + b"}" * 5000, "nested deeper"),
        (b"[" * 129 + b"]" * 129, "nested deeper than 128"),
        (b"1" * 5000, "too many digits"),
        (b'{"n": ' + b"9" * 5000 + b"}", "too many digits"),
        (b'"\xff\xfe' + SECRET.encode() + b'"', "not UTF-8"),
        (b'{"prompt": "' + SECRET.encode() + b'", oops}', "not JSON"),
        (b"", "not JSON"),
    ],
)
def test_every_failure_is_rejected_in_fixed_words(document: bytes, why: str) -> None:
    with pytest.raises(JsonRejected) as caught:
        parse_json(document, max_bytes=LIMIT)
    assert why in str(caught.value)
    assert SECRET not in str(caught.value)
    assert "oops" not in str(caught.value)


def test_the_size_is_bounded_before_parsing() -> None:
    with pytest.raises(JsonRejected, match="larger than 10 bytes"):
        parse_json(b'"' + b"a" * 20 + b'"', max_bytes=10)


def test_ordinary_documents_pass_whole() -> None:
    document = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text"}]}]}
    assert parse_json(json.dumps(document).encode(), max_bytes=LIMIT) == document
    assert parse_json(b"[" * 128 + b"]" * 128, max_bytes=LIMIT) is not None
    assert parse_json(b"3", max_bytes=LIMIT) == 3


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda children: st.lists(children) | st.dictionaries(st.text(), children),
    max_leaves=30,
)


@given(json_values)
def test_depth_is_measured_as_written(value: object) -> None:
    def depth(node: object) -> int:
        if isinstance(node, dict):
            return 1 + max((depth(v) for v in node.values()), default=0)
        if isinstance(node, list):
            return 1 + max((depth(v) for v in node), default=0)
        return 0

    measured = depth(value)
    assert not nested_deeper_than(value, measured)
    assert nested_deeper_than(value, measured - 1) == (measured > 0)


@given(st.binary(max_size=200))
def test_random_bytes_parse_or_are_rejected(data: bytes) -> None:
    with contextlib.suppress(JsonRejected):
        parse_json(data, max_bytes=LIMIT)
