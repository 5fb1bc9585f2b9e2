"""What the SQL stores' batch inboxes share: checking a batch's ids, and the result type.

A batch is checked whole before any statement runs, so a bad id never leaves
part of a batch marked: `InvalidBatch` is raised and nothing was written.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from .base import InvalidBatch

__all__ = ("MAX_ID_BYTES", "BatchResult", "HasMessageId", "check_batch", "split")

T = TypeVar("T")

MAX_ID_BYTES = 255
"""The longest id a batch takes, in UTF-8 bytes: AMQP's ``message-id`` is a short string."""


class HasMessageId(Protocol):
    """Anything with a ``message_id``, such as a [Delivery][reliable_mq.Delivery]."""

    @property
    def message_id(self) -> str:
        """The id the item is de-duplicated by."""
        ...


Item = TypeVar("Item", bound="str | HasMessageId")


@dataclass(frozen=True, slots=True)
class BatchResult(Generic[T]):
    """What ``run_once_batch`` did with one batch.

    An id repeated inside the batch counts once, at its first place.
    """

    ran: tuple[str, ...]
    """Ids new to the store: the effect got their items and committed with their marks."""

    already_done: tuple[str, ...]
    """Ids another copy had already committed: left out of the effect, nothing written."""

    value: T | None
    """What the effect returned; ``None`` if it did not run (no id was new)."""

    @property
    def effect_ran(self) -> bool:
        """Whether the effect ran (and committed), that is, whether any id was new."""
        return bool(self.ran)


def _id_of(item: object, index: int) -> str:
    message_id = item if isinstance(item, str) else getattr(item, "message_id", item)
    if not isinstance(message_id, str):
        raise InvalidBatch(f"batch item {index} has no str message id: {type(message_id).__name__}")
    if not message_id:
        raise InvalidBatch(f"batch item {index} has an empty message id (set by no publisher)")
    if "\x00" in message_id:
        raise InvalidBatch(f"batch item {index}: a message id cannot hold a NUL character")
    if len(message_id) > MAX_ID_BYTES // 4 and len(message_id.encode()) > MAX_ID_BYTES:
        raise InvalidBatch(
            f"batch item {index}: message id of {len(message_id.encode())} bytes "
            f"(at most {MAX_ID_BYTES})"
        )
    return message_id


def check_batch(items: Iterable[Item]) -> tuple[list[Item], list[str]]:
    """The batch's items and ids, first copy of each id only, in batch order.

    Raises:
        InvalidBatch: ``items`` is a bare string, or an item's id is not a
            non-empty ``str`` of at most 255 UTF-8 bytes without NUL.
    """
    if isinstance(items, str | bytes):
        raise InvalidBatch("a batch is a sequence of ids or deliveries, not one string")
    kept: list[Item] = []
    ids: list[str] = []
    seen: set[str] = set()
    for index, item in enumerate(items):
        message_id = _id_of(item, index)
        if message_id not in seen:
            seen.add(message_id)
            kept.append(item)
            ids.append(message_id)
    return kept, ids


def split(
    items: Sequence[Item], ids: Sequence[str], new: Iterable[str]
) -> tuple[list[Item], tuple[str, ...], tuple[str, ...]]:
    """The items whose ids are in ``new``, those ids and the other ids, in batch order."""
    fresh = set(new)
    todo = [item for item, message_id in zip(items, ids, strict=True) if message_id in fresh]
    ran = tuple(message_id for message_id in ids if message_id in fresh)
    done = tuple(message_id for message_id in ids if message_id not in fresh)
    return todo, ran, done
