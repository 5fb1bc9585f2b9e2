"""The fault-injection suite: one private RabbitMQ node per session, and the results table.

Every scenario runs against a node of its own (own ports, data and cookie),
never the shared broker on 5672: the faults here crash, reset and close it.
The scenarios' summary lines are printed again at the end of the run, and
appended as a Markdown table to the file named by ``FAULTS_REPORT`` if set.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.faults.harness import REPORTED
from tests.support.private_node import PrivateBroker, running_private_node


@pytest.fixture(scope="session")
def fault_node_session() -> Iterator[PrivateBroker]:
    """A private node for the whole fault suite (started once: about 8 s)."""
    with running_private_node("rfault") as node:
        yield node


@pytest.fixture
def fault_node(fault_node_session: PrivateBroker) -> PrivateBroker:
    """The session's node, started again if an earlier scenario left it down."""
    if not fault_node_session.is_running():
        fault_node_session.start()
    return fault_node_session


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not REPORTED:
        return
    terminalreporter.section("fault-injection results")
    for line in REPORTED:
        terminalreporter.write_line(line)
