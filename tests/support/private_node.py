"""A private RabbitMQ node for destructive tests (kill, restart, cut).

It runs next to the shared broker on its own ports, with its own cookie,
data and logs, so it can be crashed freely. It calls the versioned
``rabbitmq-server`` script directly: Debian's ``/usr/sbin`` wrappers switch
to the ``rabbitmq`` user and write to ``/var/log``.

Starting is blocking (several seconds). From async code, run it in a thread:
``await asyncio.to_thread(broker.start)``.
"""

from __future__ import annotations

import contextlib
import glob
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

from .amqp import run_sync, wait_for_amqp

__all__ = ("PrivateBroker", "PrivateBrokerError", "find_rabbitmq_sbin")

_SBIN_GLOB = "/usr/lib/rabbitmq/lib/rabbitmq_server-*/sbin"


class PrivateBrokerError(RuntimeError):
    """A private node could not be started, stopped or queried."""


def find_rabbitmq_sbin() -> Path | None:
    """Return the versioned RabbitMQ ``sbin`` folder, or None if not installed."""
    candidates = sorted(glob.glob(_SBIN_GLOB))
    for candidate in reversed(candidates):
        if os.access(os.path.join(candidate, "rabbitmq-server"), os.X_OK):
            return Path(candidate)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie still answers kill(0): check its state.
    with contextlib.suppress(OSError, IndexError):
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    return True


def _state(pid: int) -> str:
    """A process's state letter from /proc (D: an uninterruptible wait), or "?"."""
    with contextlib.suppress(OSError, IndexError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return "?"


def _port_open(port: int, host: str = "127.0.0.1") -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
        return True
    return False


class PrivateBroker:
    """A RabbitMQ node of its own, on its own ports and data directory.

    Args:
        base_dir: Folder for the node's home, data, logs and config; a new
            temporary folder if None. `cleanup()` removes it.
        node_name: Erlang node name; must differ from every running node.
        amqp_port: AMQP listener port (127.0.0.1 only).
        dist_port: Erlang distribution port.
        mgmt_port: Management port, used only if the management plugin is
            enabled (it is not by default).
        extra_config: lines added to ``rabbitmq.conf`` (``consumer_timeout = 4000``).
        advanced_config: the contents of ``advanced.config`` (an Erlang term,
            ``[{rabbit, [{channel_tick_interval, 1000}]}].``), or None for none.
    """

    def __init__(
        self,
        base_dir: str | os.PathLike[str] | None = None,
        *,
        node_name: str = "rtest@localhost",
        amqp_port: int = 5673,
        dist_port: int = 25673,
        mgmt_port: int = 15673,
        extra_config: str = "",
        advanced_config: str | None = None,
    ) -> None:
        sbin = find_rabbitmq_sbin()
        if sbin is None:
            raise PrivateBrokerError(f"RabbitMQ is not installed (nothing matches {_SBIN_GLOB})")
        self.sbin = sbin
        self.node_name = node_name
        self.amqp_port = amqp_port
        self.dist_port = dist_port
        self.mgmt_port = mgmt_port
        self._own_base = base_dir is None
        self.base_dir = Path(base_dir or tempfile.mkdtemp(prefix="rmq-private-")).resolve()
        self.home = self.base_dir / "home"
        self.pid_file = self.base_dir / f"{node_name.split('@', 1)[0]}.pid"
        self.log_dir = self.base_dir / "log"
        self.extra_config = extra_config
        self.advanced_config = advanced_config
        self._prepare()
        self.env = self._make_env()

    # -- setup -----------------------------------------------------------

    def _prepare(self) -> None:
        self.base_dir.mkdir(parents=True, exist_ok=True)
        self.home.mkdir(exist_ok=True)
        (self.base_dir / "mnesia").mkdir(exist_ok=True)
        self.log_dir.mkdir(exist_ok=True)
        cookie = self.home / ".erlang.cookie"
        if not cookie.exists():
            cookie.write_text(secrets.token_hex(16).upper())
        cookie.chmod(0o400)
        (self.base_dir / "rabbitmq-env.conf").write_text("")
        (self.base_dir / "enabled_plugins").write_text("[].\n")
        (self.base_dir / "rabbitmq.conf").write_text(
            f"listeners.tcp.default = 127.0.0.1:{self.amqp_port}\n"
            "loopback_users = none\n"
            # Keep short test runs quiet and small.
            "log.console = false\n"
            "log.file.level = info\n"
            f"management.tcp.port = {self.mgmt_port}\n"
            + (self.extra_config.rstrip("\n") + "\n" if self.extra_config else "")
        )
        if self.advanced_config is not None:
            (self.base_dir / "advanced.config").write_text(self.advanced_config)

    def _make_env(self) -> dict[str, str]:
        env = {
            key: value
            for key, value in os.environ.items()
            if not key.startswith(("RABBITMQ_", "ERL_"))
        }
        base = self.base_dir
        env.update(
            HOME=str(self.home),
            LANG=env.get("LANG") or "C.UTF-8",
            LC_ALL="C.UTF-8",
            RABBITMQ_NODENAME=self.node_name,
            RABBITMQ_NODE_IP_ADDRESS="127.0.0.1",
            RABBITMQ_NODE_PORT=str(self.amqp_port),
            RABBITMQ_DIST_PORT=str(self.dist_port),
            RABBITMQ_MNESIA_BASE=str(base / "mnesia"),
            RABBITMQ_LOG_BASE=str(self.log_dir),
            RABBITMQ_PID_FILE=str(self.pid_file),
            RABBITMQ_CONFIG_FILE=str(base / "rabbitmq.conf"),
            RABBITMQ_ADVANCED_CONFIG_FILE=str(base / "advanced.config"),
            RABBITMQ_ENABLED_PLUGINS_FILE=str(base / "enabled_plugins"),
            RABBITMQ_CONF_ENV_FILE=str(base / "rabbitmq-env.conf"),
            # Distribution on loopback only, like the shared broker.
            RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}",
        )
        return env

    # -- properties ------------------------------------------------------

    @property
    def url(self) -> str:
        """AMQP URL of this node (guest/guest, default vhost)."""
        return f"amqp://guest:guest@127.0.0.1:{self.amqp_port}/"

    @property
    def pid(self) -> int | None:
        """The node's OS pid from its pid file, or None."""
        try:
            return int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None

    def node_pids(self) -> set[int]:
        """OS pids of this node's Erlang VM: from the pid file, and from a scan.

        The scan finds a node that has not written its pid file yet (one
        still booting): its command line carries ``-home`` with this node's
        own home folder.
        """
        pids: set[int] = set()
        pid = self.pid
        if pid is not None and _alive(pid):
            pids.add(pid)
        marker = f"\0-home\0{self.home}\0".encode()
        with contextlib.suppress(OSError):
            for entry in os.scandir("/proc"):
                if not entry.name.isdigit():
                    continue
                with contextlib.suppress(OSError):
                    cmdline = Path(entry.path, "cmdline").read_bytes()
                    if b"beam" in cmdline.split(b"\0", 1)[0] and marker in cmdline:
                        candidate = int(entry.name)
                        if _alive(candidate):
                            pids.add(candidate)
        return pids

    def is_running(self) -> bool:
        """Whether this node's OS process is alive (booting or booted)."""
        return bool(self.node_pids())

    # -- commands --------------------------------------------------------

    def _run(
        self, script: str, *args: str, timeout: float = 120, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.sbin / script), *args]
        proc = subprocess.run(
            cmd,
            env=self.env,
            cwd=self.base_dir,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and proc.returncode != 0:
            raise PrivateBrokerError(
                f"{' '.join(cmd)} failed with exit code {proc.returncode}:\n"
                f"{proc.stdout}{proc.stderr}".rstrip()
            )
        return proc

    def rabbitmqctl(self, *args: str, timeout: float = 120) -> str:
        """Run ``rabbitmqctl -n NODE ARGS...`` against this node.

        Returns:
            The command's standard output.

        Raises:
            PrivateBrokerError: If the command fails.
        """
        return self._run("rabbitmqctl", "-n", self.node_name, *args, timeout=timeout).stdout

    def sync_metadata(self) -> None:
        """Force the node's metadata (queue and exchange definitions) to disk.

        RabbitMQ 3.10 logs a declaration to Mnesia asynchronously: a node killed
        within about a second of a durable queue's declare can come back without
        the queue, and every message confirmed into it is gone with it (1 run in
        12 here at 0.9 s; a CI run lost 15 confirmed messages that way). A crash
        test of the *messages* calls this before the kill.
        """
        self.rabbitmqctl("eval", "mnesia:sync_log().")

    def start(self, timeout: float = 60) -> None:
        """Start the node and wait until it accepts AMQP connections.

        Raises:
            PrivateBrokerError: If the port is taken or the node does not boot
                in time (the tail of its log is included).
        """
        if self.is_running():
            raise PrivateBrokerError(f"{self.node_name} is already running (pid {self.pid})")
        for port in (self.amqp_port, self.dist_port):
            if _port_open(port):
                raise PrivateBrokerError(
                    f"port {port} is already in use: is another private node still running?"
                )
        self.pid_file.unlink(missing_ok=True)  # a stale one would fool `wait`
        deadline = time.monotonic() + timeout
        # -detached forks the node and returns at once.
        self._run("rabbitmq-server", "-detached", timeout=timeout)
        try:
            self._run(
                "rabbitmqctl",
                "-n",
                self.node_name,
                "wait",
                "--timeout",
                str(max(1, int(deadline - time.monotonic()))),
                str(self.pid_file),
                timeout=timeout + 15,
            )
            remaining = max(1.0, deadline - time.monotonic())
            run_sync(lambda: wait_for_amqp(self.url, remaining))
        except (PrivateBrokerError, TimeoutError, subprocess.TimeoutExpired) as exc:
            tail = self.log_tail()
            self.kill()  # do not leave a half-started node behind
            raise PrivateBrokerError(f"{self.node_name} did not start:\n{exc}\n{tail}") from exc

    def stop(self, timeout: float = 60) -> None:
        """Stop the node gracefully; does nothing if it is not running."""
        if not self.is_running():
            return
        self.rabbitmqctl("stop", str(self.pid_file), timeout=timeout)

    def kill(self, timeout: float = 30) -> None:
        """Crash the node with SIGKILL and wait for the process to go away.

        A process in an uninterruptible wait (a quorum queue's fsync on a loaded
        disk) dies only when the wait ends: a CI run saw one outlive 10 s, and
        the next `start` found it running. It is waited for up to ``timeout``.

        Raises:
            PrivateBrokerError: it is still running after ``timeout`` (its state
                is named).
        """
        pids = self.node_pids()
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + timeout
        while self.is_running() and time.monotonic() < deadline:
            time.sleep(0.02)
        left = self.node_pids()
        if left:
            raise PrivateBrokerError(
                f"{self.node_name} outlived SIGKILL for {timeout:g} s: "
                + ", ".join(f"pid {pid} state {_state(pid)}" for pid in sorted(left))
            )
        # The AMQP port can linger for a moment while the kernel tears down.
        while _port_open(self.amqp_port) and time.monotonic() < deadline:
            time.sleep(0.02)

    def restart(self, timeout: float = 60) -> None:
        """Stop the node (if running) and start it again."""
        self.stop()
        self.start(timeout)

    def close_all_connections(self, reason: str = "closed by test") -> None:
        """Close every client connection from the server side (320 CONNECTION_FORCED)."""
        self.rabbitmqctl("close_all_connections", reason)

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the node's log files, for error messages."""
        parts: list[str] = []
        for log in sorted(self.log_dir.glob("*.log")):
            with contextlib.suppress(OSError):
                text = log.read_text(errors="replace").splitlines()[-lines:]
                parts.append(f"--- {log.name}\n" + "\n".join(text))
        return "\n".join(parts) or "(no log files)"

    def cleanup(self, *, graceful: bool = False) -> None:
        """Stop the node if it runs and remove its folder.

        Args:
            graceful: Stop with ``rabbitmqctl stop`` (about 3 s) instead of
                SIGKILL (instant); the data is deleted either way.
        """
        if graceful:
            with contextlib.suppress(PrivateBrokerError, subprocess.TimeoutExpired):
                self.stop(timeout=30)
        self.kill()
        shutil.rmtree(self.base_dir, ignore_errors=True)

    def __enter__(self) -> PrivateBroker:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cleanup()

    def __repr__(self) -> str:
        return f"<PrivateBroker {self.node_name} amqp={self.amqp_port} base={self.base_dir}>"


@contextlib.contextmanager
def running_private_node(
    prefix: str, *, extra_config: str = "", advanced_config: str | None = None
) -> Iterator[PrivateBroker]:
    """Start a private node on free ports with a unique name; remove it afterwards.

    Without RabbitMQ installed this fails under CI (``CI`` set) and skips elsewhere.
    ``extra_config`` and ``advanced_config``: see `PrivateBroker`.
    """
    import pytest

    if find_rabbitmq_sbin() is None:
        message = "RabbitMQ is not installed: this test needs a private node"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    node = PrivateBroker(
        node_name=f"{prefix}{os.getpid()}{secrets.token_hex(2)}@localhost",
        amqp_port=free_port(),
        dist_port=free_port(),
        mgmt_port=free_port(),
        extra_config=extra_config,
        advanced_config=advanced_config,
    )
    try:
        node.start()
        yield node
    finally:
        node.cleanup()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port
