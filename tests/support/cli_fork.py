"""A fork server for the CLI tests: ``python -m reliable_mq.cli ARGS`` without ~1 s of start-up each.

Starting the interpreter and importing ``reliable_mq.cli`` (pydantic, aio-pika, structlog...)
costs about a second on the shared 2-core CI machine, and ``tests/cli/test_cli.py`` ran
the command about a hundred times. The server (``python -m tests.support.cli_fork FD``)
imports the CLI once, then forks one child per command. Each child is still a process
of its own: the caller's pipes become its stdin, stdout and stderr (passed over a Unix
socket), it gets the caller's environment and arguments, runs ``main()`` and exits the
way ``sys.exit(main())`` does (atexit handlers, stream flushes, the exit status; only the
teardown of every module is skipped, see `_exit_status`). Only the interpreter start and
the imports are shared, so what a command prints, its exit code and its pipe behaviour
are those of a fresh process.

Tests that send signals, break pipes or prove the installed entry point keep spawning
``python -m reliable_mq.cli`` for real.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple, NoReturn

import pytest

ROOT = Path(__file__).resolve().parents[2]

_MAX_REQUEST = 1 << 20
"""Bytes of one request (arguments and environment); SOCK_SEQPACKET keeps it whole."""


class Run(NamedTuple):
    code: int
    stdout: str
    stderr: str


def _child(request: dict[str, Any], fds: list[int], server: socket.socket) -> NoReturn:
    """In the forked child: become the command, then exit as ``sys.exit(main())`` would."""
    server.close()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [sys.argv[0], *request["argv"]]
    from reliable_mq.cli import main  # imported (once) by serve(), before the fork

    try:
        code: object = main(request["argv"])
    except SystemExit as exc:
        code = exc.code
    except BaseException as exc:  # as the interpreter does: a traceback, then 1
        sys.excepthook(type(exc), exc, exc.__traceback__)
        code = 1
    os._exit(_exit_status(code))


def _exit_status(code: object) -> int:
    """The interpreter's exit, but for the teardown of every module.

    ``SystemExit(code)`` to a status, then the atexit handlers and the flush of stdout
    and stderr (a failed flush makes the status 120), as at a normal exit. The teardown
    is skipped: in a forked child it writes to every page the parent shared and costs
    0.5 to 1.8 s on the CI machine, and it prints nothing a command's output depends on.
    """
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:
        sys.stderr.write(f"{code}\n")
        status = 1
    atexit._run_exitfuncs()  # what Py_FinalizeEx calls first
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception as exc:  # reported much as the interpreter reports it
            with contextlib.suppress(Exception):
                sys.stderr.write(f"Exception ignored in: {stream!r}\n{exc!r}\n")
            status = 120
    return status & 0xFF


def serve(fd: int) -> None:
    """Answer requests on the SOCK_SEQPACKET socket ``fd`` until it closes.

    A request is JSON ``{"argv", "env", "cwd"}`` with three descriptors (stdin, stdout,
    stderr). The answers are ``{"pid"}`` at once and ``{"status"}`` (``os.waitstatus_to_exitcode``)
    when the child is gone. One command at a time.
    """
    import reliable_mq.cli  # noqa: F401 - the point: import once, before any fork

    gc.freeze()  # the imported objects: no collection in a child copies their pages
    server = socket.socket(fileno=fd)
    while True:
        data, fds, _, _ = socket.recv_fds(server, _MAX_REQUEST, 3)
        if not data:
            return
        request = json.loads(data)
        pid = os.fork()
        if pid == 0:
            _child(request, fds, server)
        for received in fds:
            os.close(received)
        server.send(json.dumps({"pid": pid}).encode())
        _, status = os.waitpid(pid, 0)
        server.send(json.dumps({"status": os.waitstatus_to_exitcode(status)}).encode())


class CliForkServer:
    """The test side: one server process, commands run one at a time."""

    def __init__(self, root: Path, log: Path) -> None:
        self._socket, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._log = log.open("wb")
        self._process = subprocess.Popen(
            [sys.executable, "-m", "tests.support.cli_fork", str(theirs.fileno())],
            cwd=root,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,  # a pipe or a file, as for `cli()` (never a terminal)
            stderr=self._log,
            pass_fds=(theirs.fileno(),),
        )
        theirs.close()
        self._lock = threading.Lock()
        self._log_path = log

    def run(
        self, argv: list[str], *, env: dict[str, str], cwd: Path, stdin: bytes, timeout: float
    ) -> Run:
        """Run one command to its end; blocking (call it in a thread from async code)."""
        with self._lock:
            return self._run(argv, env=env, cwd=cwd, stdin=stdin, timeout=timeout)

    def _run(
        self, argv: list[str], *, env: dict[str, str], cwd: Path, stdin: bytes, timeout: float
    ) -> Run:
        deadline = time.monotonic() + timeout
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        request = json.dumps({"argv": argv, "env": env, "cwd": str(cwd)}).encode()
        try:
            socket.send_fds(self._socket, [request], [in_r, out_w, err_w])
        finally:
            for fd in (in_r, out_w, err_w):
                os.close(fd)
        try:
            pid = int(self._answer(deadline)["pid"])
        except BaseException:
            for fd in (in_w, out_r, err_r):
                os.close(fd)
            raise
        try:
            out, err = _communicate(in_w, out_r, err_r, stdin, deadline)
            status = int(self._answer(deadline)["status"])
        except BaseException:  # our deadline, or pytest-timeout's: the next run must not wait
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                self._answer(time.monotonic() + 30)  # reaped: the server takes the next
            raise
        return Run(status, out.decode(), err.decode())

    def _answer(self, deadline: float) -> dict[str, Any]:
        self._socket.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            data = self._socket.recv(4096)
        except TimeoutError:
            raise
        except OSError as exc:  # pragma: no cover - the server died: say why
            raise RuntimeError(f"the CLI fork server failed: {self.log_tail()}") from exc
        if not data:
            raise RuntimeError(f"the CLI fork server exited: {self.log_tail()}")
        answer: dict[str, Any] = json.loads(data)
        return answer

    def log_tail(self) -> str:
        return self._log_path.read_text(errors="replace")[-4000:]

    def close(self) -> None:
        self._socket.close()  # the server's recv sees the end and it returns
        try:
            self._process.wait(30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._log.close()


@pytest.fixture(scope="session")
def cli_fork_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CliForkServer]:
    """The run's fork server, started when a test first asks for it (a pytest plugin,
    ``pytest_plugins`` in ``tests/conftest.py``)."""
    server = CliForkServer(ROOT, tmp_path_factory.mktemp("cli-fork") / "server.log")
    yield server
    server.close()


def _communicate(
    in_w: int, out_r: int, err_r: int, stdin: bytes, deadline: float
) -> tuple[bytes, bytes]:
    """Feed stdin and read stdout and stderr to their ends, as ``Popen.communicate`` does."""
    feeder = threading.Thread(target=_feed, args=(in_w, stdin), daemon=True)
    feeder.start()
    chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
    with selectors.DefaultSelector() as selector:
        for fd in (out_r, err_r):
            selector.register(fd, selectors.EVENT_READ)
        try:
            while selector.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("the command did not finish in time")
                for key, _ in selector.select(left):
                    data = os.read(int(key.fd), 65536)
                    if data:
                        chunks[int(key.fd)].append(data)
                    else:
                        selector.unregister(key.fd)
        finally:
            os.close(out_r)
            os.close(err_r)
    feeder.join(5)
    return b"".join(chunks[out_r]), b"".join(chunks[err_r])


def _feed(in_w: int, stdin: bytes) -> None:
    """Write all of stdin (unless the command stops reading it), then close it."""
    pending = memoryview(stdin)
    try:
        while pending:
            pending = pending[os.write(in_w, pending) :]
    except BrokenPipeError:
        pass  # the command stopped reading: as with a real pipe
    finally:
        os.close(in_w)


if __name__ == "__main__":
    serve(int(sys.argv[1]))
