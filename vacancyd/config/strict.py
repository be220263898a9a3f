"""cattrs, strictly: the one converter that turns untrusted data into attrs values.

cattrs' defaults are too forgiving for a daemon that guards someone's desktop: "false" is
truthy, 80.9 truncates to 80, a string where a list belongs is split into letters and
unknown keys are ignored. The converter here refuses all of these, and every problem
comes back as one line with its key path first (`upstream[0].port: expected an
integer, got '80'`), so a file is fixed in one pass. The config loader and the durable
holds file read through it.
"""

from __future__ import annotations

import re
import reprlib
from typing import Any, TypeVar

import attrs
import cattrs
from cattrs.cols import is_mapping, is_sequence, list_structure_factory, mapping_structure_factory
from cattrs.errors import ClassValidationError, ForbiddenExtraKeysError, IterableValidationError
from cattrs.gen import make_dict_structure_fn, override
from cattrs.v import format_exception, transform_error

from vacancyd.config.schema import LendingWindow

_T = TypeVar("_T")


class StrictProblems(ValueError):
    """Data that is not the value it should be: one line per problem, key path first."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


def structure(raw: Any, cls: type[_T]) -> _T:
    """`raw` (parsed TOML or JSON) as a `cls`, or StrictProblems naming every problem."""
    try:
        return _CONVERTER.structure(raw, cls)
    except (ClassValidationError, IterableValidationError) as exc:
        problems = [_key_path(m) for m in transform_error(exc, format_exception=_format_leaf)]
        raise StrictProblems(problems) from exc
    except ValueError as exc:  # the top level itself has the wrong shape
        raise StrictProblems([f"(top level): {exc}"]) from exc


def _make_repr() -> reprlib.Repr:
    shown = reprlib.Repr()
    shown.maxlevel = 3
    shown.maxlist = shown.maxdict = shown.maxtuple = shown.maxset = 6
    shown.maxstring = shown.maxother = shown.maxlong = 80
    return shown


_REPR = _make_repr()


def shown(value: Any) -> str:
    """A value as quoted in a problem line: short and bounded, however big or deep it is."""
    return _REPR.repr(value)


def _strict_int(value: Any, _: type) -> int:
    if type(value) is not int:
        raise ValueError(f"expected an integer, got {shown(value)}")
    return value


def _strict_float(value: Any, _: type) -> float:
    # TOML writes 30 and 30.0 differently; both are fine where a float is wanted.
    if type(value) not in (int, float):
        raise ValueError(f"expected a number, got {shown(value)}")
    return float(value)


def _strict_bool(value: Any, _: type) -> bool:
    if type(value) is not bool:
        raise ValueError(f"expected true or false, got {shown(value)}")
    return bool(value)


def _strict_str(value: Any, _: type) -> str:
    if type(value) is not str:
        raise ValueError(f"expected a string, got {shown(value)}")
    return str(value)


def _device(value: Any, _: type) -> int | str | None:
    if value is None or type(value) in (int, str):
        return value  # type: ignore[no-any-return]
    raise ValueError(f"expected an index or an identity string, got {shown(value)}")


def _shape_checked(expected: type, name: str, inner: Any) -> Any:
    """Wrap a structure hook so a value of the wrong shape is refused with a plain message.

    Without this a string where a list belongs is split into letters, and a scalar where
    a table belongs fails inside cattrs with an AttributeError about `.keys`.
    """

    def hook(value: Any, type_: Any) -> Any:
        if not isinstance(value, expected):
            raise ValueError(f"expected {name}, got {shown(value)}")  # noqa: TRY004 - cattrs reports ValueErrors by message
        return inner(value, type_)

    return hook


def _make_converter() -> cattrs.Converter:
    converter = cattrs.Converter(forbid_extra_keys=True)
    converter.register_structure_hook_factory(
        is_sequence,
        lambda t, c: _shape_checked(list, "a list", list_structure_factory(t, c)),
    )
    converter.register_structure_hook_factory(
        is_mapping,
        lambda t, c: _shape_checked(dict, "a table", mapping_structure_factory(t, c)),
    )
    converter.register_structure_hook_factory(
        attrs.has,
        lambda t, c: _shape_checked(
            dict,
            "a table",
            make_dict_structure_fn(t, c, _cattrs_forbid_extra_keys=True, **_renamed_keys(t)),
        ),
    )
    converter.register_structure_hook(int, _strict_int)
    converter.register_structure_hook(float, _strict_float)
    converter.register_structure_hook(bool, _strict_bool)
    converter.register_structure_hook(str, _strict_str)
    converter.register_structure_hook(int | str | None, _device)
    return converter


def _renamed_keys(cls: type) -> dict[str, Any]:
    """Fields whose TOML key is not their name (a Python keyword such as `from`)."""
    return {
        field.name: override(rename=field.metadata["key"])
        for field in attrs.fields(cls)
        if "key" in field.metadata
    }


# Python names of renamed fields, as cattrs puts them in a path, and the keys they stand for.
_KEY_OF_FIELD = {
    field.name: field.metadata["key"]
    for cls in (LendingWindow,)
    for field in attrs.fields(cls)
    if "key" in field.metadata
}

_CONVERTER = _make_converter()


def _format_leaf(exc: BaseException, type_: type | None) -> str:
    if isinstance(exc, ForbiddenExtraKeysError):
        return "unknown key(s): " + ", ".join(sorted(exc.extra_fields))
    if isinstance(exc, ValueError) and not isinstance(exc, cattrs.BaseValidationError):
        return str(exc)
    if isinstance(exc, KeyError):
        return "required key is missing"
    return format_exception(exc, type_)


def _key_path(message: str) -> str:
    """Turn cattrs' "why @ $.a.b[0]" into "a.b[0]: why", with the key path first."""
    why, _, where = message.rpartition(" @ ")
    where = where.removeprefix("$").removeprefix(".") or "(top level)"
    # Keys of a name-keyed table read as they are written in TOML: models."llama3:8b".
    where = re.sub(r"\['((?:[^'\\]|\\.)*)'\]", r'."\1"', where)
    for name, key in _KEY_OF_FIELD.items():
        where = re.sub(rf"\.{name}(?=$|[.\[])", f".{key}", where)
    return f"{where}: {why}"
