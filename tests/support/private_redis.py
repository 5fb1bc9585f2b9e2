"""A redis-server of a test's own, on a free port, that the test may kill and restart."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

__all__ = ("PrivateRedis",)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class PrivateRedis:
    """A private redis-server in ``workdir``.

    Args:
        workdir: its directory (pid file, and the append-only file if any).
        appendonly: persist every write (``appendfsync always``), so a
            ``kill -9`` and :meth:`start` again keep every acknowledged write,
            like a production Redis used for de-duplication should.
    """

    def __init__(self, workdir: Path, *, appendonly: bool = False) -> None:
        self.port = _free_port()
        self.pidfile = workdir / "redis.pid"
        self.workdir = workdir
        self.appendonly = appendonly
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start (or restart) the server and wait until it answers PING."""
        persistence = ["--appendonly", "yes", "--appendfsync", "always"] if self.appendonly else [
            "--appendonly", "no",
        ]  # fmt: skip
        subprocess.run(
            [
                "redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", *persistence, "--daemonize", "yes",
                "--pidfile", str(self.pidfile), "--dir", str(self.workdir),
            ],
            check=True,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while True:
            ping = subprocess.run(
                ["redis-cli", "-p", str(self.port), "ping"],
                check=False,
                capture_output=True,
                text=True,
            )
            if ping.stdout.strip() == "PONG" and self.pidfile.exists():
                return
            if time.monotonic() > deadline:
                raise RuntimeError("private redis-server did not start")
            time.sleep(0.05)

    def kill(self) -> None:
        """``kill -9`` the server and wait until it is gone."""
        if not self.pidfile.exists():
            return
        pid = int(self.pidfile.read_text())
        os.kill(pid, signal.SIGKILL)
        self.pidfile.unlink()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                return
            if state in ("Z", "X"):  # dead; its parent has not reaped it yet
                return
            time.sleep(0.02)
