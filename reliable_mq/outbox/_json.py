"""The JSON text of an outbox row's headers, written so that every value keeps its type in storage.

PostgreSQL keeps a jsonb number as ``numeric``: the digits survive, whether
they were an int or a float does not. Python writes ``1e19`` as ``1e+19``,
which jsonb stores and gives back as ``10000000000000000000``: an int, and one
too large for an AMQP long. So a float is written here in positional notation
with a fraction part (``10000000000000000000.0``, ``0.00000015``): ``numeric``
keeps that scale, and the digits are those of ``repr``, so ``json.loads``
reads back the very same float. SQLite keeps the text as written.

The one value that does not survive jsonb is the sign of a float zero
(``numeric`` has no ``-0``): ``-0.0`` arrives as ``0.0``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from ..errors import InvalidMessage

__all__ = ("headers_json",)


def headers_json(headers: Mapping[str, Any]) -> str:
    """Compact JSON for ``headers`` (already checked by ``encode_headers``).

    Raises:
        InvalidMessage: a value JSON has no type for (bytes, a Decimal, a
            datetime...), named by its path.
    """
    parts: list[str] = []
    _write(headers, "headers", parts)
    return "".join(parts)


def _write(value: Any, path: str, out: list[str]) -> None:
    if value is None:
        out.append("null")
    elif value is True or value is False:
        out.append("true" if value else "false")
    elif isinstance(value, str):
        out.append(json.dumps(value))
    elif isinstance(value, int):
        out.append(int.__repr__(value))
    elif isinstance(value, float):
        out.append(_float_text(value, path))
    elif isinstance(value, Mapping):
        out.append("{")
        for index, (key, item) in enumerate(value.items()):
            out.append("," if index else "")
            out.append(json.dumps(key) + ":")
            _write(item, f"{path}[{key[:40]!r}]", out)
        out.append("}")
    elif isinstance(value, (list, tuple)):
        out.append("[")
        for index, item in enumerate(value):
            out.append("," if index else "")
            _write(item, f"{path}[{index}]", out)
        out.append("]")
    else:
        raise InvalidMessage(
            f"{path}: a {type(value).__name__} is not a JSON value "
            "(outbox headers are str, int, float, bool, None, lists and maps)"
        )


def _float_text(value: float, path: str) -> str:
    """``value`` in positional notation with a fraction part: ``1e+19`` → ``10000000000000000000.0``."""
    if not math.isfinite(value):
        raise InvalidMessage(f"{path}: {value!r} is not a finite number")
    text = float.__repr__(value)
    if "e" in text:
        text = format(Decimal(text), "f")
    return text if "." in text else text + ".0"
