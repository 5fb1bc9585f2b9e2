"""What every SQL-backed piece shares: safe table names and password-free database errors.

Used by the outbox (`reliable_mq.outbox`) and the SQL de-duplication stores
(`reliable_mq.dedup.postgres`), neither of which imports the other.
"""

from __future__ import annotations

import re

from .settings import redact_credentials

__all__ = ("check_table_name", "error_text", "redact_dsn")

_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,47}(\.[a-z_][a-z0-9_]{0,47})?$")
_KEYWORD_PASSWORD = re.compile(r"(\bpassword\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", re.IGNORECASE)
_URL_QUERY_PASSWORD = re.compile(r"([?&]password=)[^&\s]*", re.IGNORECASE)


def check_table_name(table: str, *, what: str = "table") -> str:
    """Return ``table`` if it is a plain (optionally schema-qualified) lower-case identifier.

    The name is put into SQL text, so nothing else is accepted.

    Args:
        table: the name to check.
        what: what the table is, for the error ("outbox table", "dedup table").

    Raises:
        ValueError: the name is not ``[a-z_][a-z0-9_]*`` (48 characters at most per part).
    """
    if not isinstance(table, str) or not _NAME.match(table):
        raise ValueError(
            f"{what} name must be a lower-case identifier (optionally schema.table), not {table!r}"
        )
    return table


def redact_dsn(text: str) -> str:
    """Hide every password in ``text``: URL user info, ``password=`` keywords and query parameters.

    Works on a DSN (``postgresql://u:pw@h/db``, ``host=h password=pw``) and on
    free text quoting one (a driver's error message).
    """
    text = redact_credentials(text)
    text = _URL_QUERY_PASSWORD.sub(r"\1***", text)
    return _KEYWORD_PASSWORD.sub(r"\1***", text)


def error_text(error: BaseException) -> str:
    """A driver error as one line with every password hidden (libpq's span several lines)."""
    return redact_dsn(" ".join(str(error).split()))
