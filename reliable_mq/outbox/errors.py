"""The outbox's own errors, under ``ReliableMQError``.

```
ReliableMQError
└── OutboxError
    ├── NotInTransaction       (also ValueError)       add() on a connection in autocommit
    ├── UnsupportedConnection  (also TypeError)        add() got something it cannot write to
    └── OutboxUnavailable      (also ConnectionError)  the relay cannot reach its database
```

Invalid events (a body that cannot be encoded, a routing key that is not a
string, a body over the size limit) raise the package's usual
``InvalidMessage``, ``InvalidBody`` and ``MessageTooLarge`` before anything
is written. Errors never quote a DSN's password.
"""

from __future__ import annotations

from ..errors import ReliableMQError

__all__ = ("NotInTransaction", "OutboxError", "OutboxUnavailable", "UnsupportedConnection")


class OutboxError(ReliableMQError):
    """Base of the outbox's errors."""


class NotInTransaction(OutboxError, ValueError):
    """``add()`` was given a connection in autocommit mode with no transaction open.

    The event would be committed on its own, apart from your business change:
    exactly what an outbox is there to prevent. Open a transaction first.
    """


class UnsupportedConnection(OutboxError, TypeError):
    """``add()`` was given an object it cannot write through (or a database it does not know)."""


class OutboxUnavailable(OutboxError, ConnectionError):
    """The relay (or a CLI command) could not reach or use the outbox database.

    The message names the database with its password redacted.
    """
