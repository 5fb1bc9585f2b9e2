"""Turning a publish() body into bytes and a content type."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

from .errors import InvalidBody

__all__ = ("JSON_CONTENT_TYPE", "encode_body")

JSON_CONTENT_TYPE = "application/json"
TEXT_CONTENT_TYPE = "text/plain; charset=utf-8"
BYTES_CONTENT_TYPE = "application/octet-stream"


def encode_body(body: Any) -> tuple[bytes, str]:
    """Encode ``body`` and name its content type.

    bytes pass through, str is UTF-8 text, a pydantic model is its JSON, and
    dicts, lists and other JSON-able values are JSON.

    Raises:
        InvalidBody: the value cannot be encoded (text with a lone surrogate included).
    """
    if isinstance(body, bytes):
        return body, BYTES_CONTENT_TYPE
    try:
        if isinstance(body, str):
            return body.encode(), TEXT_CONTENT_TYPE
        if isinstance(body, BaseModel):
            return body.model_dump_json().encode(), JSON_CONTENT_TYPE
        if isinstance(body, (bytearray, memoryview)):
            return bytes(body), BYTES_CONTENT_TYPE
        encoded = json.dumps(body, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        return encoded.encode(), JSON_CONTENT_TYPE
    except UnicodeEncodeError as exc:  # a lone surrogate ("\ud800") in the text
        culprit = exc.object[exc.start : exc.end].encode("unicode_escape").decode("ascii")
        raise InvalidBody(
            f"body text is not encodable as UTF-8: a lone surrogate {culprit} at index {exc.start}"
        ) from None
    except (TypeError, ValueError) as exc:  # pydantic's serialisation error is a ValueError
        raise InvalidBody(
            f"cannot encode a {type(body).__name__} body: pass bytes, str, a pydantic "
            f"model or JSON-serialisable data ({_printable(exc)})"
        ) from None


def _printable(exc: BaseException) -> str:
    """``str(exc)`` with anything not encodable as UTF-8 escaped."""
    return str(exc).encode("utf-8", "backslashreplace").decode("utf-8")
