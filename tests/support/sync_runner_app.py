"""A Router with a plain ``def`` handler, for tests/sync/test_sync_handlers.py (``reliable-mq run``).

``SYNC_RUNNER_QUEUE``: the queue; ``SYNC_RUNNER_OUT``: a file where each handled
message id and the handler's thread name are appended before the handler returns.
A message with the id ``stuck`` is written with the prefix ``stuck`` and never
returns (a handler Python cannot interrupt).
"""

from __future__ import annotations

import os
import threading

from reliable_mq import Delivery, Router

QUEUE = os.environ.get("SYNC_RUNNER_QUEUE", "sync-runner-test")
OUT = os.environ.get("SYNC_RUNNER_OUT", "")

router = Router()


@router.handler(QUEUE)
def handle(body: bytes, delivery: Delivery) -> None:
    line = f"{delivery.message_id} {threading.current_thread().name}\n".encode()
    fd = os.open(OUT, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
    if delivery.message_id == "stuck":
        threading.Event().wait()  # forever
