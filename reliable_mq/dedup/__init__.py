"""De-duplication stores for idempotent consumers.

``MemoryDedupStore`` (one process) and ``SQLiteDedupStore`` (one host) are
here; ``RedisDedupStore`` (every host) lives in `reliable_mq.dedup.redis`
and needs the ``redis`` extra: from a clone, ``pip install '.[redis]'``.
"""

from ._batch import BatchResult
from .base import (
    AlreadyProcessed,
    ClaimResult,
    DedupStore,
    DedupStoreUnavailable,
    InvalidBatch,
)
from .memory import MemoryDedupStore
from .sqlite import SQLiteDedupStore

__all__ = (
    "AlreadyProcessed",
    "BatchResult",
    "ClaimResult",
    "DedupStore",
    "DedupStoreUnavailable",
    "InvalidBatch",
    "MemoryDedupStore",
    "SQLiteDedupStore",
)
