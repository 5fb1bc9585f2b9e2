"""Process-wide hooks of the blocking publishers: interpreter exit and fork.

Installed on the first ``BlockingPublisher()``, never at import. A publisher
that has connected is held by a strong reference until it is closed, so one
dropped without ``close()`` still has its submitted messages confirmed at
exit. At exit, every publisher still open in this process is closed: all of
them start closing at once, and each is given at most its ``exit_timeout``
plus `EXIT_MARGIN` seconds. In a forked child, every publisher forgets the
parent's loop thread and connection (they belong to the parent), drops the
child's copies of their file descriptors without sending anything, and
reconnects on first use: the same thing SQLAlchemy's ``dispose(close=False)``
and redis-py's pid check do.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import weakref
from collections.abc import Callable
from typing import Protocol

__all__ = ("EXIT_MARGIN", "ProcessBound", "hold", "orphan", "release", "track")

EXIT_MARGIN = 2.0
"""Seconds past ``exit_timeout`` an at-exit close may take at most (closing the
connection, stopping the loop thread). After that the process exits anyway:
the loop thread is a daemon."""


class ProcessBound(Protocol):
    """What the hooks call on a publisher they track (`BlockingPublisher` implements it).

    The hooks know publishers only through this interface: they never import
    the publisher's module (which imports them).
    """

    def _start_close_at_exit(self) -> Callable[[], None] | None:
        """Begin closing at interpreter exit; return what waits for the end (None: nothing to)."""
        ...

    def _after_fork_in_child(self) -> None:
        """In a forked child: forget the parent's loop thread and connection."""
        ...


class _Registry:
    """The publishers of this process, and whether the hooks are installed."""

    def __init__(self) -> None:
        self.instances: weakref.WeakSet[ProcessBound] = weakref.WeakSet()
        self.open: set[ProcessBound] = set()
        """Publishers with a runtime in this process, not closed yet (strong references)."""
        self.orphans: list[object] = []
        self.lock = threading.Lock()
        self.installed = False


_registry = _Registry()


def track(publisher: ProcessBound) -> None:
    """Remember ``publisher`` for the exit and fork hooks (installed once)."""
    with _registry.lock:
        _registry.instances.add(publisher)
        if not _registry.installed:
            _registry.installed = True
            atexit.register(_close_all_at_exit)
            os.register_at_fork(after_in_child=_after_fork_in_child)


def hold(publisher: ProcessBound) -> None:
    """Keep ``publisher`` alive until `release`: it has a connection to close at exit."""
    with _registry.lock:
        _registry.open.add(publisher)


def release(publisher: ProcessBound) -> None:
    """``publisher`` is closed (or lost its parent's runtime in a child): drop the hold."""
    with _registry.lock:
        _registry.open.discard(publisher)


def orphan(runtime: object) -> None:
    """Keep a parent's runtime referenced in the child, unused and never finalized."""
    _registry.orphans.append(runtime)


def _close_all_at_exit() -> None:
    with _registry.lock:
        publishers = list(_registry.open)
    finishing: list[Callable[[], None]] = []
    for publisher in publishers:  # every close starts before any is waited for
        with contextlib.suppress(Exception):
            finish = publisher._start_close_at_exit()
            if finish is not None:
                finishing.append(finish)
    for finish in finishing:
        with contextlib.suppress(Exception):
            finish()


def _after_fork_in_child() -> None:
    _registry.lock = threading.Lock()  # a parent thread may have held it at fork time
    for publisher in list(_registry.instances):
        publisher._after_fork_in_child()
    _registry.open.clear()  # the parent's runtimes are orphans here; nothing to close at exit
