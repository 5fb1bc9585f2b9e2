"""Structured Streaming: a foreachBatch sink, and stopping a query after a batch's confirms.

``query.stop()`` on its own cancels the running micro-batch's Spark job: its
tasks are killed mid-partition, messages in flight end with an unknown
outcome, and the batch is not committed, so Spark replays it (same ids) when
the query restarts. Nothing is lost, but the broker may hold part of the batch
twice. The functions here wait for the batch in progress to be confirmed first.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from pyspark.sql import DataFrame

from ._driver import PublishReport, check_destination, publish_dataframe
from ._errors import StreamStopping
from ._spec import PublishSpec

__all__ = ("BatchSink", "foreach_batch_sink", "stop_after_current_batch")


class BatchSink:
    """A ``writeStream.foreachBatch`` function that publishes each micro-batch.

    The batch id goes in the ``x-spark-batch-id`` header. Spark replays a batch
    with the same id after a failure; the replay sends the same message ids.
    The destination is checked before the first batch only.

    Args:
        spec: where and how.
        on_report: called on the driver with each batch's `PublishReport`.
        check: run `check_destination` before the first batch.
    """

    def __init__(
        self,
        spec: PublishSpec,
        *,
        on_report: Callable[[PublishReport], None] | None = None,
        check: bool = True,
    ) -> None:
        self.spec = spec
        self._on_report = on_report
        self._checked = not check
        self._state = threading.Condition()
        self._busy = False
        self._stopping = False

    def __call__(self, batch_df: DataFrame, batch_id: int) -> None:
        with self._state:
            if self._stopping:
                raise StreamStopping(
                    f"micro-batch {batch_id} began after a graceful stop was asked for; "
                    "nothing of it was published and Spark replays it on restart"
                )
            self._busy = True
        try:
            if not self._checked:
                check_destination(self.spec)
                self._checked = True
            report = publish_dataframe(batch_df, self.spec, batch_id=int(batch_id), check=False)
            if self._on_report is not None:
                self._on_report(report)
        finally:
            with self._state:
                self._busy = False
                self._state.notify_all()

    def stop(self, query: Any, timeout: float | None = None) -> bool:
        """Stop ``query`` once the micro-batch in progress is published and confirmed.

        No new batch is published after this is called: one that begins
        raises `StreamStopping` before publishing anything (it is replayed
        on restart). Then ``query.stop()`` runs between batches.

        Args:
            query: the ``StreamingQuery`` running this sink.
            timeout: seconds to wait for the batch in progress; then the query
                is stopped anyway (like a plain ``query.stop()``).

        Returns:
            True if the query stopped between batches, False if ``timeout``
            passed first.
        """
        with self._state:
            self._stopping = True
            idle = self._state.wait_for(lambda: not self._busy, timeout)
        query.stop()
        return idle


def foreach_batch_sink(
    spec: PublishSpec,
    *,
    on_report: Callable[[PublishReport], None] | None = None,
    check: bool = True,
) -> BatchSink:
    """A `BatchSink` for ``writeStream.foreachBatch`` (keep it to call ``sink.stop(query)``)."""
    return BatchSink(spec, on_report=on_report, check=check)


def stop_after_current_batch(query: Any, *, timeout: float | None = None) -> bool:
    """Stop any streaming query between micro-batches (``writeStream.format("rabbitmq")``).

    Waits until no trigger is active (the batch in progress has published,
    been confirmed and committed), then calls ``query.stop()``. A trigger that
    begins in the few milliseconds between that check and the stop is
    interrupted like a plain ``query.stop()``: nothing is lost, the batch is
    replayed on restart with the same ids. `BatchSink.stop` has no such window.

    Returns:
        True if the query stopped between batches, False if ``timeout`` passed first.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    while query.isActive:
        if not query.status.get("isTriggerActive", False):
            query.stop()
            return True
        if deadline is not None and time.monotonic() >= deadline:
            query.stop()
            return False
        time.sleep(0.05)
    return True  # it had stopped already
