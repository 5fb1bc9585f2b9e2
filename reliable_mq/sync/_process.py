"""Process-wide hooks of the blocking publishers: interpreter exit and fork.

Installed on the first ``BlockingPublisher()``, never at import. At exit,
every publisher running in this process is closed (bounded by its
``exit_timeout``). In a forked child, every publisher forgets the parent's
loop thread and connection (they belong to the parent) and reconnects on
first use: the same thing SQLAlchemy's ``dispose(close=False)`` and redis-py's
pid check do.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._publisher import BlockingPublisher

__all__ = ("orphan", "track")


class _Registry:
    """The publishers of this process, and whether the hooks are installed."""

    def __init__(self) -> None:
        self.instances: weakref.WeakSet[BlockingPublisher] = weakref.WeakSet()
        self.orphans: list[object] = []
        self.lock = threading.Lock()
        self.installed = False


_registry = _Registry()


def track(publisher: BlockingPublisher) -> None:
    """Remember ``publisher`` for the exit and fork hooks (installed once)."""
    with _registry.lock:
        _registry.instances.add(publisher)
        if not _registry.installed:
            _registry.installed = True
            atexit.register(_close_all_at_exit)
            os.register_at_fork(after_in_child=_after_fork_in_child)


def orphan(runtime: object) -> None:
    """Keep a parent's runtime referenced in the child, unused and never finalized."""
    _registry.orphans.append(runtime)


def _close_all_at_exit() -> None:
    for publisher in list(_registry.instances):
        with contextlib.suppress(Exception):
            publisher._close_at_exit()


def _after_fork_in_child() -> None:
    _registry.lock = threading.Lock()  # a parent thread may have held it at fork time
    for publisher in list(_registry.instances):
        publisher._after_fork_in_child()
