"""Run by tests/sync/test_sync_faults.py: a parent publishes, forks, the child publishes.

Prints one JSON line per stage on stdout. The parent waits for a line on stdin
before it forks, the child for another before it closes, so the test can look
at the broker's connections at each stage. Each report lists the TCP sockets to
the broker's port that the process holds (socket inodes from ``/proc``), so the
test can see that the child holds none of the parent's.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from urllib.parse import urlsplit

from reliable_mq import ConnectionSettings
from reliable_mq.sync import BlockingPublisher


def report(**fields: object) -> None:
    print(json.dumps(fields), flush=True)  # noqa: T201 - the report goes to the test


def broker_sockets(port: int) -> list[int]:
    """Inodes of this process's TCP sockets whose remote port is ``port`` (Linux)."""
    held = set()
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            held.add(int(target[8:-1]))
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            remote_port = int(fields[2].rsplit(":", 1)[1], 16)
            inode = int(fields[9])
            if remote_port == port and inode in held:
                found.append(inode)
    return sorted(found)


def main() -> None:
    url, queue, name = sys.argv[1:4]
    port = urlsplit(url).port or 5672
    publisher = BlockingPublisher(ConnectionSettings(url=url, connection_name=name))
    publisher.publish(b"parent", routing_key=queue, message_id="parent-before")
    auto = publisher.publish(b"parent", routing_key=queue).message_id
    report(
        stage="parent-connected",
        connection=publisher.connection_name,
        auto_id=auto,
        sockets=broker_sockets(port),
    )
    sys.stdin.readline()  # the test lists the broker's connections first
    pid = os.fork()
    if pid == 0:
        try:
            at_fork = broker_sockets(port)  # before the child's own connection
            result = publisher.publish(b"child", routing_key=queue, message_id="child")
            auto = publisher.publish(b"child", routing_key=queue).message_id
            report(
                stage="child-published",
                connection=publisher.connection_name,
                auto_id=auto,
                attempts=result.attempts,
                generation=publisher.stats().channel_generation,
                sockets_at_fork=at_fork,
                sockets=broker_sockets(port),
            )
            sys.stdin.readline()
            publisher.close()
        except BaseException as exc:
            report(stage="child-failed", error=repr(exc))
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    result = publisher.publish(b"parent", routing_key=queue, message_id="parent-after")
    stats = publisher.stats()
    report(
        stage="parent-after",
        child_exit=os.waitstatus_to_exitcode(status),
        connection=publisher.connection_name,
        attempts=result.attempts,
        generation=stats.channel_generation,
        republished=stats.republished,
        sockets=broker_sockets(port),
    )
    publisher.close()


if __name__ == "__main__":
    main()
