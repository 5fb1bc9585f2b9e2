"""The transactional outbox: events committed with your data, published with confirms.

Write the event in the same transaction as the business change:

```python
async with session.begin():
    session.add(Order(id=42, total=99))
    await outbox.add(session, {"order_id": 42}, routing_key="orders", ordering_key="42")
```

and run a relay (``reliable-mq outbox relay --dsn ... --url ...`` or
[OutboxRelay][reliable_mq.outbox.OutboxRelay]) that publishes committed rows
and removes them once the broker confirmed them. A rolled-back transaction
publishes nothing; a committed one is published at least once, in
``ordering_key`` order. The consumer side (the inbox) is
[PostgresDedupStore][reliable_mq.dedup.postgres.PostgresDedupStore].

PostgreSQL needs the ``postgres`` extra (from a clone: ``pip install '.[postgres]'``)
for the relay; SQLite works with the standard library alone.
"""

from ._backend import OutboxRow, RowOutcome
from ._dsn import redact_dsn
from ._schema import DEFAULT_TABLE, Dialect, RowState, schema_sql
from ._writer import DEFAULT_MAX_BODY, add, add_sync
from .errors import NotInTransaction, OutboxError, OutboxUnavailable, UnsupportedConnection
from .relay import OutboxRelay, RelaySettings, RelayStats

__all__ = (
    "DEFAULT_MAX_BODY",
    "DEFAULT_TABLE",
    "Dialect",
    "NotInTransaction",
    "OutboxError",
    "OutboxRelay",
    "OutboxRow",
    "OutboxUnavailable",
    "RelaySettings",
    "RelayStats",
    "RowOutcome",
    "RowState",
    "UnsupportedConnection",
    "add",
    "add_sync",
    "redact_dsn",
    "schema_sql",
)
