"""A body schema from its DDL text, parsed in Python: a data source has no JVM at hand.

PySpark's own ``_parse_datatype_string`` asks the active SparkContext's JVM,
and a Python data source's ``schema()`` and ``reader()`` run in a Python
worker that has none. This parser reads the DDL of the types a JSON body can
be read into (`reliable_mq.spark._json_types`), e.g.

```
id BIGINT, name STRING, tags ARRAY<STRING>, at TIMESTAMP,
price DECIMAL(10,2), address STRUCT<city: STRING, zip STRING>,
attrs MAP<STRING, DOUBLE>, `odd name` INT NOT NULL COMMENT 'why'
```

Type names are case-insensitive, with Spark's synonyms (``INT``/``INTEGER``,
``BIGINT``/``LONG``, ...). A schema already in Spark's JSON form
(``StructType.json()``, text starting with ``{``) is read as such.
"""

from __future__ import annotations

import json
import re

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
    StructField,
    StructType,
    TimestampNTZType,
    TimestampType,
)

__all__ = ("parse_schema",)

_SIMPLE: dict[str, DataType] = {
    "string": StringType(),
    "boolean": BooleanType(),
    "tinyint": ByteType(),
    "byte": ByteType(),
    "smallint": ShortType(),
    "short": ShortType(),
    "int": IntegerType(),
    "integer": IntegerType(),
    "bigint": LongType(),
    "long": LongType(),
    "float": FloatType(),
    "real": FloatType(),
    "double": DoubleType(),
    "date": DateType(),
    "timestamp": TimestampType(),
    "timestamp_ltz": TimestampType(),
    "timestamp_ntz": TimestampNTZType(),
    "binary": BinaryType(),
}
_TOKEN = re.compile(r"\s*(`(?:[^`]|``)*`|'(?:[^'\\]|\\.)*'|\w+|[<>(),:]|\S)")


class _Tokens:
    def __init__(self, text: str) -> None:
        self.items = _TOKEN.findall(text.rstrip())
        self.at = 0

    def peek(self) -> str:
        return self.items[self.at] if self.at < len(self.items) else ""

    def take(self, expected: str | None = None) -> str:
        token = self.peek()
        if not token or (expected is not None and token.lower() != expected):
            want = repr(expected) if expected else "more"
            raise ValueError(
                f"expected {want} at token {self.at + 1}, found {token or 'the end'!r}"
            )
        self.at += 1
        return token

    def accept(self, word: str) -> bool:
        if self.peek().lower() == word:
            self.at += 1
            return True
        return False


def parse_schema(text: str) -> StructType:
    """The struct a DDL (or JSON) schema text describes.

    Raises:
        ValueError: the text does not parse, or names a type without a JSON reading.
    """
    if text.lstrip().startswith("{"):
        try:
            return StructType.fromJson(json.loads(text))
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"not a struct's JSON ({exc!r})") from None
    tokens = _Tokens(text)
    if not tokens.peek():
        raise ValueError("an empty schema")
    fields = _fields(tokens, end="")
    if tokens.peek():
        raise ValueError(f"unexpected {tokens.peek()!r} at token {tokens.at + 1}")
    return StructType(fields)


def _fields(tokens: _Tokens, *, end: str) -> list[StructField]:
    fields = [_field(tokens)]
    while tokens.accept(","):
        fields.append(_field(tokens))
    if end:
        tokens.take(end)
    names = [f.name for f in fields]
    if len(set(names)) != len(names):
        raise ValueError(f"a field name is repeated in {names}")
    return fields


def _field(tokens: _Tokens) -> StructField:
    name = _name(tokens.take())
    tokens.accept(":")
    kind = _type(tokens)
    nullable = True
    if tokens.accept("not"):
        tokens.take("null")
        nullable = False
    if tokens.accept("comment"):
        comment = tokens.take()
        if not comment.startswith("'"):
            raise ValueError(f"COMMENT takes a quoted text, not {comment!r}")
    return StructField(name, kind, nullable)


def _name(token: str) -> str:
    if token.startswith("`"):
        return token[1:-1].replace("``", "`")
    if not re.fullmatch(r"\w+", token):
        raise ValueError(f"{token!r} is not a field name (quote odd names with backticks)")
    return token


def _type(tokens: _Tokens) -> DataType:  # noqa: PLR0911 (one return per type constructor)
    word = tokens.take().lower()
    if word in _SIMPLE:
        return _SIMPLE[word]
    if word in ("decimal", "dec", "numeric"):
        if not tokens.accept("("):
            return DecimalType()
        precision = int(tokens.take())
        scale = int(tokens.take()) if tokens.accept(",") else 0
        tokens.take(")")
        if not 0 < precision <= 38 or not 0 <= scale <= precision:
            raise ValueError(f"DECIMAL({precision},{scale}) is out of Spark's range")
        return DecimalType(precision, scale)
    if word == "array":
        tokens.take("<")
        element = _type(tokens)
        tokens.take(">")
        return ArrayType(element, True)
    if word == "map":
        tokens.take("<")
        key = _type(tokens)
        tokens.take(",")
        value = _type(tokens)
        tokens.take(">")
        return MapType(key, value, True)
    if word == "struct":
        tokens.take("<")
        if tokens.accept(">"):
            return StructType([])
        return StructType(_fields(tokens, end=">"))
    raise ValueError(
        f"no JSON reading for type {word!r} (supported: {', '.join(_SIMPLE)}, "
        "decimal, array, map, struct)"
    )
