"""Parsed JSON to the Python values of a Spark type, checked: ``from_json`` for a data source.

`converter` compiles a schema once into nested functions; each takes a value
from ``json.loads`` and returns what a Spark row holds for that type (a tuple
for a struct, a list for an array, a dict for a map), or raises `Mismatch`
naming the field's path. Missing fields and JSON ``null`` are None; fields
the schema does not name are ignored.
"""

from __future__ import annotations

import datetime as dt
import decimal
import json
from collections.abc import Callable
from typing import Any

from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    BooleanType,
    ByteType,
    DataType,
    DateType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    MapType,
    ShortType,
    StringType,
    StructType,
    TimestampNTZType,
    TimestampType,
)

__all__ = ("Convert", "Mismatch", "converter")

Convert = Callable[[Any], Any]
"""One value from ``json.loads`` to the value a Spark row holds (None stays None)."""

_INTEGRAL: dict[type[DataType], int] = {ByteType: 8, ShortType: 16, IntegerType: 32, LongType: 64}


class Mismatch(ValueError):
    """A body that is not JSON, or a value of another type than the schema's."""


def converter(kind: DataType, path: str = "value") -> Convert:
    """The checked conversion of a JSON value to ``kind`` (``path`` names it in errors).

    Raises:
        TypeError: ``kind`` has no JSON reading (intervals, variant...): found on
            the driver, when the format is built.
    """
    inner = _converter(kind, path)

    def convert(value: Any) -> Any:
        return None if value is None else inner(value)

    return convert


def _converter(kind: DataType, path: str) -> Convert:  # noqa: PLR0911 (one return per type)
    if isinstance(kind, StructType):
        return _struct(kind, path)
    if isinstance(kind, ArrayType):
        element = converter(kind.elementType, f"{path}[]")
        return lambda value: [element(item) for item in _expect(value, list, path)]
    if isinstance(kind, MapType):
        if not isinstance(kind.keyType, StringType):
            raise TypeError(f"{path}: a JSON object's keys are strings, not {kind.keyType}")
        values = converter(kind.valueType, f"{path}{{}}")
        return lambda value: {k: values(v) for k, v in _expect(value, dict, path).items()}
    if isinstance(kind, StringType):
        return lambda value: value if isinstance(value, str) else json.dumps(value)
    if type(kind) in _INTEGRAL:
        return _integral(_INTEGRAL[type(kind)], path)
    if isinstance(kind, FloatType | DoubleType):
        return lambda value: _float(value, path)
    if isinstance(kind, BooleanType):
        return lambda value: _expect(value, bool, path)
    if isinstance(kind, DecimalType):
        return _decimal(kind, path)
    if isinstance(kind, TimestampType | TimestampNTZType):
        return _timestamp(path, aware=isinstance(kind, TimestampType))
    if isinstance(kind, DateType):
        return lambda value: _parsed(dt.date.fromisoformat, _expect(value, str, path), path)
    if isinstance(kind, BinaryType):
        import base64  # noqa: PLC0415

        return lambda value: _parsed(base64.b64decode, _expect(value, str, path), path)
    raise TypeError(f"{path}: {kind.simpleString()} has no JSON reading")


def _struct(kind: StructType, path: str) -> Convert:
    fields = [(f.name, converter(f.dataType, f"{path}.{f.name}")) for f in kind.fields]

    def convert(value: Any) -> tuple[Any, ...]:
        found = _expect(value, dict, path)
        return tuple(field(found.get(name)) for name, field in fields)

    return convert


def _integral(bits: int, path: str) -> Convert:
    low, high = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1

    def convert(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise Mismatch(f"{path}: expected an integer, got {_kind(value)}")
        if not low <= value <= high:
            raise Mismatch(f"{path}: {value} is out of range for {bits}-bit integers")
        return value

    return convert


def _decimal(kind: DecimalType, path: str) -> Convert:
    exponent = decimal.Decimal(1).scaleb(-kind.scale)

    def convert(value: Any) -> decimal.Decimal:
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise Mismatch(f"{path}: expected a number, got {_kind(value)}")
        try:
            number = decimal.Decimal(str(value)).quantize(exponent)
        except decimal.InvalidOperation:
            raise Mismatch(f"{path}: {str(value)[:40]!r} is not a {kind.simpleString()}") from None
        if len(number.as_tuple().digits) > kind.precision:
            raise Mismatch(f"{path}: {number} does not fit {kind.simpleString()}")
        return number

    return convert


def _timestamp(path: str, *, aware: bool) -> Convert:
    def convert(value: Any) -> dt.datetime:
        text = _expect(value, str, path)
        moment: dt.datetime = _parsed(dt.datetime.fromisoformat, text, path)
        if aware and moment.tzinfo is None:
            moment = moment.replace(tzinfo=dt.UTC)  # no zone: UTC
        if not aware and moment.tzinfo is not None:
            moment = moment.replace(tzinfo=None)
        return moment

    return convert


def _expect(value: Any, kind: type, path: str) -> Any:
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise Mismatch(f"{path}: expected {_KINDS[kind]}, got {_kind(value)}")
    return value


def _float(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise Mismatch(f"{path}: expected a number, got {_kind(value)}")
    try:
        return float(value)
    except OverflowError:
        raise Mismatch(f"{path}: a number too large for a double") from None


def _parsed(parse: Callable[[str], Any], text: str, path: str) -> Any:
    try:
        return parse(text)
    except ValueError:
        raise Mismatch(f"{path}: {text[:40]!r} does not parse") from None


_KINDS: dict[type, str] = {
    dict: "an object",
    list: "an array",
    str: "a string",
    bool: "true or false",
}


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true or false"
    if isinstance(value, int | float):
        return "a number"
    return _KINDS.get(type(value), type(value).__name__)
