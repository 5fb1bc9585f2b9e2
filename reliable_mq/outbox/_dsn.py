"""Database names for logs and errors: a DSN with its password hidden, and which database it is."""

from __future__ import annotations

import os
from pathlib import Path

from .._sql import error_text, redact_dsn
from ._schema import Dialect

__all__ = ("describe_database", "dialect_of", "error_text", "redact_dsn", "sqlite_path")


def dialect_of(database: str | os.PathLike[str]) -> Dialect:
    """PostgreSQL for a libpq URL or keyword DSN; SQLite for a path or ``sqlite:///path``."""
    if isinstance(database, os.PathLike):
        return Dialect.SQLITE
    if database.startswith(("postgresql://", "postgres://")) or "=" in database.split("/")[0]:
        return Dialect.POSTGRES
    return Dialect.SQLITE


def sqlite_path(database: str | os.PathLike[str]) -> Path:
    """The file of an SQLite database given as a path or an ``sqlite:///`` URL."""
    text = os.fspath(database)
    if text.startswith("sqlite:///"):
        text = text[len("sqlite:///") :]
    elif text.startswith("sqlite://"):
        raise ValueError("an sqlite:// URL needs three slashes and a path: sqlite:///path/to.db")
    return Path(text)


def describe_database(database: str | os.PathLike[str]) -> str:
    """A short, password-free name of the database for logs."""
    if dialect_of(database) is Dialect.SQLITE:
        return f"sqlite:{sqlite_path(database)}"
    return redact_dsn(os.fspath(database))
