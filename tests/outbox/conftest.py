"""One private PostgreSQL server for the outbox tests (own port and data directory).

Tests give every table a unique name, so they share one server, started once
per run (it was once per module: seven starts); the shared server on 5432 is
never used here. No test here stops or kills it (the outage tests cut a proxy).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.private_postgres import PrivatePostgres, running_private_postgres


@pytest.fixture(scope="session")
def pg() -> Iterator[PrivatePostgres]:
    """The outbox tests' private PostgreSQL server."""
    with running_private_postgres() as server:
        yield server


@pytest.fixture
def dsn(pg: PrivatePostgres) -> str:
    return pg.dsn
