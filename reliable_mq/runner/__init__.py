"""Run consumers as supervised worker processes: ``reliable-mq run module:consumer``.

The command line is the usual way in (see the deployment guide); this package
is what it runs. [Supervisor][reliable_mq.runner.Supervisor] starts
``workers`` processes, restarts one that exits with a backoff, serves
``/livez``, ``/readyz`` and ``/metrics`` on one port, and drains every worker
gracefully on SIGTERM.
"""

from ._supervisor import RunnerOptions, Supervisor, WorkerState
from ._target import load_consumer

__all__ = ("RunnerOptions", "Supervisor", "WorkerState", "load_consumer")
