"""Helpers for testing code that uses reliable_mq against a real broker.

``TCPProxy`` sits between your client and RabbitMQ and can cut, stall or
blackhole the link, so a test can prove what happens when the network fails.
"""

from ._proxy import TCPProxy, Traffic
from .oracle import LossOracle, OracleReport

__all__ = ("LossOracle", "OracleReport", "TCPProxy", "Traffic")
