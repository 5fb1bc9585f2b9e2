"""The fault-injection suite: the run's private RabbitMQ node, and the results table.

Every scenario runs against the private node (own ports, data and cookie; one
per session, shared with the other private-node tests, each on queues of its
own), never the shared broker on 5672: the faults here crash, reset and close it.
The scenarios' summary lines are printed again at the end of the run, and
appended as a Markdown table to the file named by ``FAULTS_REPORT`` if set.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.faults.harness import REPORTED
from tests.support.private_node import PrivateBroker


@pytest.fixture
def fault_node(private_broker: PrivateBroker) -> PrivateBroker:
    """The run's private node (tests/conftest.py), started again if an earlier test left it down."""
    return private_broker


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not REPORTED:
        return
    terminalreporter.section("fault-injection results")
    for line in REPORTED:
        terminalreporter.write_line(line)
