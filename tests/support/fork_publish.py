"""Run by tests/test_sync_faults.py: a parent publishes, forks, the child publishes.

Prints one JSON line per stage on stdout. The parent waits for a line on stdin
before it forks, the child for another before it closes, so the test can look
at the broker's connections at each stage.
"""

from __future__ import annotations

import json
import os
import sys

from reliable_mq import ConnectionSettings
from reliable_mq.sync import BlockingPublisher


def report(**fields: object) -> None:
    print(json.dumps(fields), flush=True)  # noqa: T201 - the report goes to the test


def main() -> None:
    url, queue, name = sys.argv[1:4]
    publisher = BlockingPublisher(ConnectionSettings(url=url, connection_name=name))
    publisher.publish(b"parent", routing_key=queue, message_id="parent-before")
    auto = publisher.publish(b"parent", routing_key=queue).message_id
    report(stage="parent-connected", connection=publisher.connection_name, auto_id=auto)
    sys.stdin.readline()  # the test lists the broker's connections first
    pid = os.fork()
    if pid == 0:
        try:
            result = publisher.publish(b"child", routing_key=queue, message_id="child")
            auto = publisher.publish(b"child", routing_key=queue).message_id
            report(
                stage="child-published",
                connection=publisher.connection_name,
                auto_id=auto,
                attempts=result.attempts,
                generation=publisher.stats().channel_generation,
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
    )
    publisher.close()


if __name__ == "__main__":
    main()
