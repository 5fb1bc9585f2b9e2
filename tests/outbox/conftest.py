"""One private PostgreSQL server per test module (own port and data directory).

Tests give every table a unique name, so a module's tests share its server;
the shared server on 5432 is never used here.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.private_postgres import PrivatePostgres, running_private_postgres


@pytest.fixture(scope="module")
def pg() -> Iterator[PrivatePostgres]:
    """A private PostgreSQL server for this module."""
    with running_private_postgres() as server:
        yield server


@pytest.fixture
def dsn(pg: PrivatePostgres) -> str:
    return pg.dsn
