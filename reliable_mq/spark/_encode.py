"""Schema-directed encoders: strict JSON bodies, canonical id text, AMQP header values.

Built from the DataFrame's schema, never guessed from values: the driver checks
the schema before any task runs (`schema_problems`), and each executor builds
one small function per column. Rows arrive as tuples in schema order: PySpark
``Row`` objects (``df.rdd``) or tuples made from Arrow batches (the data
source). Nested structs arrive as ``Row``/tuples or dicts, maps as dicts or
lists of pairs; both are accepted.

Three flavours:

* **body**: JSON following Spark's ``to_json`` where it is faithful: column
  order kept (map keys sorted: PySpark's conversion loses map order), timestamps ISO-8601 with the offset of the session time zone,
  decimals as plain numbers at their scale (``0.0000001``, never ``1E-7``),
  binary as base64, FLOAT in its shortest float32 form. Unlike ``to_json``:
  null fields are written (``"c":null``) and timestamps keep microseconds.
* **canonical**: the text ids are made of: object keys sorted, timestamps as
  UTC instants (``...Z``), so two instants of a DST fold never merge, and the
  text never depends on the session or worker time zone; decimals without
  trailing zeros, so every representation of one value gives one id.
* **header**: AMQP header values (str, int, float, bool, bytes, None); dates,
  timestamps and decimals as text so no precision is lost.
"""

from __future__ import annotations

import base64
import datetime as dt
import math
import struct
from collections.abc import Callable, Iterable
from decimal import Context, Decimal
from json.encoder import encode_basestring
from typing import Any

from pyspark.sql import Row
from pyspark.sql.types import (
    AnsiIntervalType,
    ArrayType,
    BinaryType,
    BooleanType,
    CalendarIntervalType,
    CharType,
    DataType,
    DateType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegralType,
    MapType,
    NullType,
    StringType,
    StructField,
    StructType,
    TimestampNTZType,
    TimestampType,
    VarcharType,
    VariantType,
)

from ..errors import InvalidBody
from ._spec import NonFinite

__all__ = (
    "Encode",
    "HeaderEncode",
    "body_encoder",
    "canonical_encoder",
    "canonical_value",
    "header_encoder",
    "row_problems",
    "struct_encoder",
    "type_problems",
)

Encode = Callable[[Any], str]
"""One value to its JSON text."""
HeaderEncode = Callable[[Any], Any]
"""One value to an AMQP header value."""

_ATOMIC = (
    NullType,
    BooleanType,
    IntegralType,
    FloatType,
    DoubleType,
    DecimalType,
    StringType,
    CharType,
    VarcharType,
    BinaryType,
    DateType,
    TimestampType,
    TimestampNTZType,
)
_MAP_KEYS = (StringType, CharType, VarcharType, IntegralType, BooleanType)
_DECIMAL_CONTEXT = Context(prec=100)
_NON_FINITE_TEXT = {math.inf: "Infinity", -math.inf: "-Infinity"}


# -- the driver-side check ------------------------------------------------------------


def type_problems(data_type: DataType, path: str) -> list[tuple[str, str]]:
    """Every reason ``data_type`` (at column ``path``) cannot be encoded faithfully."""
    problems: list[tuple[str, str]] = []
    _collect(data_type, path, problems)
    return problems


def row_problems(schema: StructType, columns: Iterable[str]) -> list[tuple[str, str]]:
    """Problems of the named top-level columns, plus duplicate top-level names."""
    problems = _duplicates(schema.fields, "")
    by_name = {f.name: f for f in schema.fields}
    for name in dict.fromkeys(columns):
        field = by_name.get(name)
        if field is not None:
            _collect(field.dataType, name, problems)
    return problems


def _duplicates(fields: list[StructField], prefix: str) -> list[tuple[str, str]]:
    seen: set[str] = set()
    problems: list[tuple[str, str]] = []
    for field in fields:
        if field.name in seen:
            problems.append(
                (
                    prefix + field.name,
                    "duplicate column name (a join?): one value would be lost in the JSON "
                    "body; rename or drop one of them",
                )
            )
        seen.add(field.name)
    return problems


def _collect(data_type: DataType, path: str, problems: list[tuple[str, str]]) -> None:
    if isinstance(data_type, StructType):
        problems.extend(_duplicates(data_type.fields, path + "."))
        for field in data_type.fields:
            _collect(field.dataType, f"{path}.{field.name}", problems)
    elif isinstance(data_type, ArrayType):
        _collect(data_type.elementType, path + "[]", problems)
    elif isinstance(data_type, MapType):
        if not isinstance(data_type.keyType, _MAP_KEYS):
            problems.append(
                (
                    path,
                    f"map keys of type {data_type.keyType.simpleString()} have no JSON "
                    "form; keys must be strings, integers or booleans (e.g. "
                    "transform_keys(c, (k, v) -> CAST(k AS STRING)))",
                )
            )
        _collect(data_type.valueType, path + "{}", problems)
    elif not isinstance(data_type, _ATOMIC):
        problems.append((path, _unsupported(data_type)))


def _unsupported(data_type: DataType) -> str:
    name = data_type.simpleString()
    if isinstance(data_type, (AnsiIntervalType, CalendarIntervalType)):
        hint = "cast it to a string or a number (e.g. seconds)"
    elif isinstance(data_type, VariantType):
        hint = "turn it into a string column with to_json()"
    else:
        hint = "cast it to a supported type or leave the column out"
    return f"type {name} has no faithful JSON or header form; {hint}"


# -- body and canonical JSON -----------------------------------------------------------


def body_encoder(data_type: DataType, path: str, zone: dt.tzinfo, non_finite: NonFinite) -> Encode:
    """The JSON-text encoder of a body value of ``data_type`` (timestamps in ``zone``)."""
    return _json(data_type, path, _BodyStyle(zone, non_finite))


def canonical_encoder(data_type: DataType, path: str) -> Encode:
    """The canonical-text encoder of ``data_type``, for message ids."""
    return _json(data_type, path, None)


def struct_encoder(
    fields: list[StructField], path: str, zone: dt.tzinfo | None, non_finite: NonFinite
) -> Encode:
    """A JSON object of ``fields`` from a tuple in field order; canonical if ``zone`` is None."""
    style = None if zone is None else _BodyStyle(zone, non_finite)
    return _struct(fields, path, style)


class _BodyStyle:
    __slots__ = ("non_finite", "zone")

    def __init__(self, zone: dt.tzinfo, non_finite: NonFinite) -> None:
        self.zone = zone
        self.non_finite = non_finite


def _json(data_type: DataType, path: str, style: _BodyStyle | None) -> Encode:  # noqa: PLR0911, PLR0912 (a codec: one branch per Spark type)
    if isinstance(data_type, StructType):
        return _struct(data_type.fields, path, style)
    if isinstance(data_type, ArrayType):
        return _array(_json(data_type.elementType, path + "[]", style))
    if isinstance(data_type, MapType):
        return _map(data_type, path, style)
    if isinstance(data_type, (StringType, CharType, VarcharType)):
        return _nullable(encode_basestring)
    if isinstance(data_type, BooleanType):
        return _nullable(lambda v: "true" if v else "false")
    if isinstance(data_type, IntegralType):
        return _nullable(int.__repr__)
    if isinstance(data_type, (DoubleType, FloatType)):
        return _float(data_type, path, style)
    if isinstance(data_type, DecimalType):
        if style is None:
            return _nullable(decimal_id_text)
        return _nullable(_decimal_text(data_type.scale))
    if isinstance(data_type, BinaryType):
        return _nullable(lambda v: '"' + base64.b64encode(v).decode("ascii") + '"')
    if isinstance(data_type, DateType):
        return _nullable(lambda v: '"' + v.isoformat() + '"')
    if isinstance(data_type, TimestampType):
        return _timestamp(path, style)
    if isinstance(data_type, TimestampNTZType):
        return _nullable(lambda v: '"' + v.isoformat(timespec="microseconds") + '"')
    if isinstance(data_type, NullType):
        return lambda v: "null"
    raise InvalidBody(f"column {path}: {_unsupported(data_type)}")  # the driver checked


def _nullable(encode: Encode) -> Encode:
    def encode_or_null(value: Any) -> str:
        return "null" if value is None else encode(value)

    return encode_or_null


def _struct(fields: list[StructField], path: str, style: _BodyStyle | None) -> Encode:
    names = [f.name for f in fields]
    parts = [
        (index, encode_basestring(f.name) + ":", _json(f.dataType, _join(path, f.name), style))
        for index, f in enumerate(fields)
    ]
    if style is None:  # canonical: sorted like `canonical_value` sorts dict keys
        parts.sort(key=lambda part: part[1][:-1])

    def encode(value: Any) -> str:
        if value is None:
            return "null"
        if isinstance(value, dict):
            value = [value.get(name) for name in names]
        return "{" + ",".join([label + enc(value[i]) for i, label, enc in parts]) + "}"

    return encode


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _array(element: Encode) -> Encode:
    def encode(value: Any) -> str:
        if value is None:
            return "null"
        return "[" + ",".join([element(item) for item in value]) + "]"

    return encode


def _map(data_type: MapType, path: str, style: _BodyStyle | None) -> Encode:
    key_text = _map_key(data_type.keyType)
    value_text = _json(data_type.valueType, path + "{}", style)

    def encode(value: Any) -> str:
        if value is None:
            return "null"
        pairs = value.items() if isinstance(value, dict) else value
        # Sorted in bodies too: PySpark's row conversion does not keep map order.
        texts = sorted([(key_text(k), value_text(v)) for k, v in pairs])
        return "{" + ",".join([k + ":" + v for k, v in texts]) + "}"

    return encode


def _map_key(data_type: DataType) -> Encode:
    if isinstance(data_type, BooleanType):
        return lambda k: '"true"' if k else '"false"'
    if isinstance(data_type, IntegralType):
        return lambda k: '"' + int.__repr__(k) + '"'
    return encode_basestring


def _float(data_type: DataType, path: str, style: _BodyStyle | None) -> Encode:
    finite = _float32_text if style is not None and isinstance(data_type, FloatType) else repr
    if style is None:

        def canonical(value: Any) -> str:
            if value is None:
                return "null"
            if math.isfinite(value):
                return finite(value)
            return '"' + _NON_FINITE_TEXT.get(value, "NaN") + '"'

        return canonical
    policy = style.non_finite

    def body(value: Any) -> str:
        if value is None:
            return "null"
        if math.isfinite(value):
            return finite(value)
        if policy is NonFinite.STRING:
            return '"' + _NON_FINITE_TEXT.get(value, "NaN") + '"'
        if policy is NonFinite.NULL:
            return "null"
        raise _non_finite_error(path, value)

    return body


def _non_finite_error(path: str, value: float) -> InvalidBody:
    return InvalidBody(
        f"column {path} holds {_NON_FINITE_TEXT.get(value, 'NaN')}, which is not valid "
        "JSON; set non_finite='string' (Spark's to_json form) or 'null' to publish it"
    )


def _float32_text(value: float) -> str:
    """The shortest decimal text that reads back as the same float32 (as Java prints it)."""
    for digits in range(6, 10):
        text = f"{value:.{digits}g}"
        if struct.unpack("f", struct.pack("f", float(text)))[0] == value:
            break
    if "e" in text:
        mantissa, exponent = text.split("e")
        if "." not in mantissa:
            mantissa += ".0"
        return f"{mantissa}e{int(exponent)}"
    return text if "." in text else text + ".0"


def _decimal_text(scale: int) -> Encode:
    quantum = Decimal(1).scaleb(-scale)

    def text(value: Decimal) -> str:
        return format(value.quantize(quantum, context=_DECIMAL_CONTEXT), "f")

    return text


def decimal_id_text(value: Decimal) -> str:
    """A decimal in ids: plain, without trailing zeros, the same for every representation.

    ``Decimal('9.00E-7')`` (as ``collect()`` returns a ``DECIMAL(20,7)``),
    ``Decimal('9E-7')`` and ``Decimal('0.0000009')`` are all ``0.0000009``;
    ``1.0000000`` is ``1``; a zero of any scale or sign is ``0``.
    """
    if not value.is_finite():
        raise InvalidBody(f"no canonical form for the decimal {value}")
    if not value:
        return "0"
    text = format(value, "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


def _timestamp(path: str, style: _BodyStyle | None) -> Encode:
    zone = dt.UTC if style is None else style.zone
    suffix = "Z" if style is None else ""

    def encode(value: Any) -> str:
        if value is None:
            return "null"
        # A naive value is the worker's local time (PySpark's conversion, with
        # ``fold`` set in a DST fall-back hour); an aware one is exact (Arrow).
        try:
            local: dt.datetime = value.astimezone(zone)
        except (OverflowError, ValueError) as exc:
            raise InvalidBody(f"column {path}: timestamp {value!r} out of range ({exc})") from None
        if suffix:
            local = local.replace(tzinfo=None)
        return '"' + local.isoformat(timespec="microseconds") + suffix + '"'

    return encode


# -- AMQP header values ----------------------------------------------------------------


def header_encoder(  # noqa: PLR0911 (a codec: one branch per Spark type)
    data_type: DataType, path: str, zone: dt.tzinfo, non_finite: NonFinite
) -> HeaderEncode:
    """An AMQP header value of ``data_type``; text where AMQP would lose precision."""
    if isinstance(data_type, (StringType, CharType, VarcharType, BooleanType, IntegralType)):
        return _identity
    if isinstance(data_type, BinaryType):
        return lambda v: None if v is None else bytearray(v)  # AMQP byte array
    if isinstance(data_type, (FloatType, DoubleType)):  # written as AMQP doubles: exact
        return _header_float(path, non_finite)
    if isinstance(data_type, NullType):
        return lambda v: None
    text = body_encoder(data_type, path, zone, non_finite)
    if isinstance(data_type, (DecimalType,)):
        return lambda v: None if v is None else text(v)
    if isinstance(data_type, (DateType, TimestampType, TimestampNTZType)):
        return lambda v: None if v is None else text(v)[1:-1]  # without the JSON quotes
    return lambda v: None if v is None else text(v)  # structs, arrays, maps: JSON text


def _identity(value: Any) -> Any:
    return value


def _header_float(path: str, non_finite: NonFinite) -> HeaderEncode:
    def encode(value: Any) -> Any:
        if value is None or math.isfinite(value):
            return value
        if non_finite is NonFinite.STRING:
            return _NON_FINITE_TEXT.get(value, "NaN")
        if non_finite is NonFinite.NULL:
            return None
        raise _non_finite_error(path, value)

    return encode


# -- canonical text of plain Python values (message_id_for) ---------------------------


def canonical_value(value: Any) -> str:  # noqa: PLR0911, PLR0912 (a codec: one branch per Python value type)
    """The canonical text of a Python value, as the schema-directed encoder writes it.

    Naive datetimes are taken as TIMESTAMP_NTZ values; pass aware datetimes for
    TIMESTAMP columns. A decimal is written without trailing zeros, so every
    representation of one value (any scale) gives the same text.
    """
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return int.__repr__(value)
    if isinstance(value, float):
        if math.isfinite(value):
            return repr(value)
        return '"' + _NON_FINITE_TEXT.get(value, "NaN") + '"'
    if isinstance(value, str):
        return encode_basestring(value)
    if isinstance(value, Decimal):
        return decimal_id_text(value)
    if isinstance(value, (bytes, bytearray)):
        return '"' + base64.b64encode(value).decode("ascii") + '"'
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            return '"' + value.isoformat(timespec="microseconds") + '"'
        utc = value.astimezone(dt.UTC).replace(tzinfo=None)
        return '"' + utc.isoformat(timespec="microseconds") + 'Z"'
    if isinstance(value, dt.date):
        return '"' + value.isoformat() + '"'
    if isinstance(value, Row):
        value = value.asDict(recursive=False)
    if isinstance(value, dict):
        items = sorted((_key_text(k), canonical_value(v)) for k, v in value.items())
        return "{" + ",".join(k + ":" + v for k, v in items) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(canonical_value(item) for item in value) + "]"
    raise InvalidBody(f"no canonical form for a {type(value).__name__} value")


def _key_text(key: Any) -> str:
    if isinstance(key, bool):
        return '"true"' if key else '"false"'
    if isinstance(key, int):
        return '"' + int.__repr__(key) + '"'
    if isinstance(key, str):
        return encode_basestring(key)
    raise InvalidBody(f"map keys must be str, int or bool, not {type(key).__name__}")
