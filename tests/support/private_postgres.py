"""A PostgreSQL server of a test module's own: free port, own data directory, removed after.

It runs next to the shared server on 5432 and never touches it. ``initdb``
refuses to run as root, so as root the server's commands run as the
``postgres`` user (through ``runuser``) in a temporary folder that user owns.
``fsync`` is off: the tests crash clients, never this server, and a commit
reaches the OS before the client is told.

Starting is blocking (about 2 s for ``initdb``, under 1 s to start). From
async code, run it in a thread.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = ("PG_BIN", "PrivatePostgres", "PrivatePostgresError", "running_private_postgres")

PG_BIN = Path(os.environ.get("RELIABLE_MQ_PG_BIN", "/usr/lib/postgresql/15/bin"))


class PrivatePostgresError(RuntimeError):
    """The private server could not be created, started or stopped."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class PrivatePostgres:
    """A throw-away PostgreSQL cluster on 127.0.0.1 and a free port.

    Args:
        base_dir: the folder for data, socket and log; a new temporary folder if None.
    """

    def __init__(self, base_dir: str | os.PathLike[str] | None = None) -> None:
        if not (PG_BIN / "initdb").exists():
            raise PrivatePostgresError(f"PostgreSQL server binaries not found in {PG_BIN}")
        self.port = _free_port()
        self.base_dir = Path(base_dir or tempfile.mkdtemp(prefix="rmq-pg-")).resolve()
        self.data_dir = self.base_dir / "data"
        self.socket_dir = self.base_dir / "run"
        self.log_file = self.base_dir / "postgres.log"
        self._as_postgres = os.geteuid() == 0
        self._prepared = False

    @property
    def dsn(self) -> str:
        """A libpq URL for the ``postgres`` database as the ``postgres`` superuser."""
        return self.dsn_for("postgres")

    def dsn_for(self, dbname: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"

    def _cmd(self, *args: str) -> list[str]:
        return ["runuser", "-u", "postgres", "--", *args] if self._as_postgres else list(args)

    def _run(self, *args: str, timeout: float = 120) -> None:
        proc = subprocess.run(
            self._cmd(*args),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            cwd=self.base_dir,
            env={**os.environ, "LC_ALL": "C.UTF-8", "LANG": "C.UTF-8"},
        )
        if proc.returncode != 0:
            raise PrivatePostgresError(
                f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}\n"
                f"{self.log_tail()}"
            )

    def _prepare(self) -> None:
        self.socket_dir.mkdir(parents=True, exist_ok=True)
        if self._as_postgres:
            user = pwd.getpwnam("postgres")
            for path in (self.base_dir, self.socket_dir):
                os.chown(path, user.pw_uid, user.pw_gid)
        self._run(
            str(PG_BIN / "initdb"),
            "-D",
            str(self.data_dir),
            "--username=postgres",
            "--auth=trust",
            "--encoding=UTF8",
            "--no-sync",
        )
        with open(self.data_dir / "postgresql.conf", "a") as conf:
            conf.write(
                f"port = {self.port}\n"
                "listen_addresses = '127.0.0.1'\n"
                f"unix_socket_directories = '{self.socket_dir}'\n"
                "fsync = off\n"
                "full_page_writes = off\n"
                "max_connections = 60\n"
                "shared_buffers = 32MB\n"
            )
        self._prepared = True

    def start(self, timeout: float = 60) -> None:
        """Create the cluster on first use, start it and wait until it accepts connections."""
        if not self._prepared:
            self._prepare()
        self._run(
            str(PG_BIN / "pg_ctl"),
            "-D",
            str(self.data_dir),
            "-l",
            str(self.log_file),
            "-w",
            "-t",
            str(int(timeout)),
            "start",
            timeout=timeout + 10,
        )

    def stop(self) -> None:
        """Stop fast (rolls back open transactions); does nothing if it is not running."""
        if self.pid() is None:
            return
        self._run(str(PG_BIN / "pg_ctl"), "-D", str(self.data_dir), "-m", "fast", "-w", "stop")

    def pid(self) -> int | None:
        with contextlib.suppress(OSError, ValueError, IndexError):
            pid = int((self.data_dir / "postmaster.pid").read_text().splitlines()[0])
            os.kill(pid, 0)
            return pid
        return None

    def kill(self) -> None:
        """SIGKILL the postmaster (its children exit when they notice)."""
        pid = self.pid()
        if pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                os.kill(pid, 0)
                time.sleep(0.02)
                continue
            break

    def log_tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        return "(no log)"

    def cleanup(self) -> None:
        """Stop the server (fast, else SIGKILL) and remove its folder."""
        with contextlib.suppress(PrivatePostgresError, subprocess.TimeoutExpired):
            self.stop()
        self.kill()
        shutil.rmtree(self.base_dir, ignore_errors=True)


@contextlib.contextmanager
def running_private_postgres() -> Iterator[PrivatePostgres]:
    """A started private server, removed afterwards even on failure.

    Without the server binaries this fails under CI (``CI`` set) and skips elsewhere.
    """
    import pytest

    try:
        server = PrivatePostgres()
    except PrivatePostgresError as exc:
        if os.environ.get("CI"):
            pytest.fail(str(exc))
        pytest.skip(str(exc))
    try:
        server.start()
        yield server
    finally:
        server.cleanup()
