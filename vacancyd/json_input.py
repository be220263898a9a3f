"""Reading JSON that came from outside the daemon: one reader, bounded, failing one way.

JSON reaches vacancyd from borrowers (work bodies), from the owner's tools (admin bodies)
and from upstream servers (vacancyd's own reads of /api/ps, /props, /queue, ...). Any of
them may be hostile or broken, and Python's parser fails in more ways than `ValueError`:
a document nested a thousand deep raises `RecursionError`, a 5,000-digit integer raises
`ValueError` with its own wording, a huge one `MemoryError`. A caller that catches only
the usual error turns such a document into a 500 with a traceback, or, in a background
task, into a daemon that exits.

So every outside document goes through `parse_json`, which bounds the size before parsing
and the nesting depth after, and turns every way parsing can fail into `JsonRejected`
with a fixed message. The message never quotes the input: these messages reach logs,
/status and the diagnostics archive, and a borrower's prompt or an upstream's answer has
no business there.
"""

from __future__ import annotations

import json
from typing import Any

# Deep enough for any real document: OpenAI tool schemas and ComfyUI graphs nest a few
# tens of levels at most; Python's parser itself gives up somewhere under a thousand.
MAX_DEPTH = 128


class JsonRejected(ValueError):
    """The document cannot be used; the message says why in fixed words, never quoting it."""


def parse_json(data: bytes, *, max_bytes: int, max_depth: int = MAX_DEPTH) -> Any:
    """The value of a UTF-8 JSON document of at most `max_bytes`, nested at most
    `max_depth` deep; JsonRejected for anything else, whatever the parser raised."""
    if len(data) > max_bytes:
        raise JsonRejected(f"it is larger than {max_bytes} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise JsonRejected("it is not UTF-8 text") from None
    try:
        value = json.loads(text)
    except RecursionError:
        raise JsonRejected("it is nested deeper than the parser allows") from None
    except MemoryError:
        raise JsonRejected("it is too large to parse") from None
    except json.JSONDecodeError as exc:
        # The parser's own words and a position: nothing of the document itself.
        raise JsonRejected(
            f"it is not JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
        ) from None
    except ValueError:
        # int() refuses numbers of more than sys.get_int_max_str_digits() digits.
        raise JsonRejected("it holds a number with too many digits") from None
    if nested_deeper_than(value, max_depth):
        raise JsonRejected(f"it is nested deeper than {max_depth} levels")
    return value


def nested_deeper_than(value: Any, limit: int) -> bool:
    """Whether arrays and objects nest more than `limit` levels (iteratively: a deep
    document must not recurse here either)."""
    if not isinstance(value, dict | list):
        return False
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        for child in node.values() if isinstance(node, dict) else node:
            if isinstance(child, dict | list):
                stack.append((child, depth + 1))
    return False
