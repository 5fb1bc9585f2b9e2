"""TLS against a real listener: a private RabbitMQ node with certificates made in the test.

One node per module (``listeners.ssl.default``) with a private CA from
``trustme``. The node verifies every certificate a client presents
(``verify_peer``) but does not demand one (``fail_if_no_peer_cert = false``),
so one listener serves both server-only TLS and mutual TLS, and a client
certificate from another CA is refused. The server certificate names
``localhost`` only, so connecting to ``127.0.0.1`` is a hostname mismatch.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import aio_pika
import pytest
import trustme
from prometheus_client import CollectorRegistry

from reliable_mq import (
    BrokerUnavailable,
    ConnectionSettings,
    Delivery,
    ReliableConsumer,
    ReliablePublisher,
    TLSSettings,
    declare_topology,
)
from reliable_mq.topology import QueueTopology, delete_topology
from tests.support.private_node import PrivateBroker, find_rabbitmq_sbin, free_port
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.private_broker, pytest.mark.timeout(180)]

CLIENT_NAME = "reliable-mq-test-client"
"""The common name of the client certificate our CA issues."""


@dataclass(frozen=True)
class TLSNode:
    node: PrivateBroker
    port: int
    ca_file: str
    client_cert: str
    client_key: str
    stranger_cert: str
    stranger_key: str

    def url(self, host: str = "localhost") -> str:
        return f"amqps://guest:guest@{host}:{self.port}/"

    def tls_connections(self) -> list[dict[str, object]]:
        """The node's TLS connections, as ``rabbitmqctl list_connections`` sees them."""
        out = self.node.rabbitmqctl(
            "list_connections", "client_properties", "ssl", "peer_cert_subject",
            "peer_cert_issuer", "--formatter", "json",
        )  # fmt: skip
        return [row for row in json.loads(out) if row.get("ssl")]


def _client(ca: trustme.CA) -> trustme.LeafCert:
    return ca.issue_cert(CLIENT_NAME, common_name=CLIENT_NAME)


def _write_pair(cert: trustme.LeafCert, folder: Path, name: str) -> tuple[str, str]:
    cert.cert_chain_pems[0].write_to_path(str(folder / f"{name}.pem"))
    cert.private_key_pem.write_to_path(str(folder / f"{name}.key"))
    return str(folder / f"{name}.pem"), str(folder / f"{name}.key")


@pytest.fixture(scope="module")
def tls_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TLSNode]:
    if find_rabbitmq_sbin() is None:
        if os.environ.get("CI"):
            pytest.fail("RabbitMQ is not installed: the TLS tests need a private node")
        pytest.skip("RabbitMQ is not installed")
    certs = tmp_path_factory.mktemp("certs")
    ca, other_ca = trustme.CA(), trustme.CA()
    ca.cert_pem.write_to_path(str(certs / "ca.pem"))
    ca.issue_cert("localhost").private_key_and_cert_chain_pem.write_to_path(
        str(certs / "server.pem")
    )
    # The same client name from two CAs: only the CA differs.
    client_cert, client_key = _write_pair(_client(ca), certs, "client")
    stranger_cert, stranger_key = _write_pair(_client(other_ca), certs, "stranger")
    node = PrivateBroker(
        node_name=f"rtls{os.getpid()}{secrets.token_hex(2)}@localhost",
        amqp_port=free_port(),
        dist_port=free_port(),
        mgmt_port=free_port(),
    )
    port = free_port()
    with (node.base_dir / "rabbitmq.conf").open("a") as conf:
        conf.write(
            f"listeners.ssl.default = 127.0.0.1:{port}\n"
            f"ssl_options.cacertfile = {certs / 'ca.pem'}\n"
            f"ssl_options.certfile = {certs / 'server.pem'}\n"
            f"ssl_options.keyfile = {certs / 'server.pem'}\n"
            "ssl_options.verify = verify_peer\n"
            "ssl_options.fail_if_no_peer_cert = false\n"
        )
    try:
        node.start()
        yield TLSNode(
            node, port, str(certs / "ca.pem"), client_cert, client_key, stranger_cert, stranger_key
        )
    finally:
        node.cleanup()


@pytest.fixture(name="tls_queue")
async def _tls_queue(tls_node: TLSNode) -> AsyncIterator[str]:
    """A queue name on the TLS node; its queue set is deleted afterwards (over plain AMQP)."""
    name = f"tls-{uuid.uuid4().hex[:8]}"
    yield name
    connection = await aio_pika.connect(tls_node.node.url)
    async with connection:
        await delete_topology(await connection.channel(), QueueTopology(name))


def _settings(url: str, tls: TLSSettings | None) -> ConnectionSettings:
    return ConnectionSettings(
        url=url,  # type: ignore[arg-type]
        tls=tls,
        connect_timeout=10,
        connection_name=f"tls-{uuid.uuid4().hex[:6]}",
    )


async def _publish(settings: ConnectionSettings, queue: str, count: int) -> set[str]:
    await declare_topology(settings, queue)
    async with ReliablePublisher(settings, registry=CollectorRegistry()) as publisher:
        return {
            (await publisher.publish({"n": n}, routing_key=queue)).message_id for n in range(count)
        }


class TestServerTLS:
    """The client checks the broker; the broker asks nothing of the client."""

    async def test_a_private_ca_without_a_client_certificate(
        self, tls_node: TLSNode, tls_queue: str
    ) -> None:
        """ca_file alone: the broker's certificate is verified, hostname included; confirmed."""
        settings = _settings(tls_node.url(), TLSSettings(ca_file=tls_node.ca_file))
        assert len(await _publish(settings, tls_queue, 20)) == 20

    async def test_the_system_trust_store_rejects_a_private_ca(self, tls_node: TLSNode) -> None:
        """No ca_file: the system store does not know the private CA; a typed error says so."""
        for tls in (TLSSettings(), None):  # explicit defaults, and none at all for amqps://
            with pytest.raises(BrokerUnavailable, match="CERTIFICATE_VERIFY_FAILED") as caught:
                async with ReliablePublisher(
                    _settings(tls_node.url(), tls), registry=CollectorRegistry()
                ):
                    pass
            assert "guest:guest" not in str(caught.value)

    async def test_a_hostname_mismatch_is_rejected(self, tls_node: TLSNode) -> None:
        """The certificate names localhost; 127.0.0.1 is not it, though the CA is trusted."""
        settings = _settings(tls_node.url("127.0.0.1"), TLSSettings(ca_file=tls_node.ca_file))
        with pytest.raises(BrokerUnavailable, match=r"CERTIFICATE_VERIFY_FAILED.*mismatch"):
            async with ReliablePublisher(settings, registry=CollectorRegistry()):
                pass


class TestMutualTLS:
    """The client presents a certificate and the broker verifies it."""

    async def test_the_broker_sees_the_client_certificate(
        self, tls_node: TLSNode, tls_queue: str
    ) -> None:
        """Publishing works, and the broker's connection shows our certificate's subject."""
        tls = TLSSettings(
            ca_file=tls_node.ca_file, cert_file=tls_node.client_cert, key_file=tls_node.client_key
        )
        settings = _settings(tls_node.url(), tls)
        await declare_topology(settings, tls_queue)
        async with ReliablePublisher(settings, registry=CollectorRegistry()) as publisher:
            await publisher.publish({"n": 1}, routing_key=tls_queue)
            ours = [
                row
                for row in tls_node.tls_connections()
                if settings.connection_name in json.dumps(row["client_properties"])
            ]
        assert ours, tls_node.tls_connections()
        assert all(f"CN={CLIENT_NAME}" in str(row["peer_cert_subject"]) for row in ours), ours
        # ...and a server-only TLS client shows none.
        plain = _settings(tls_node.url(), TLSSettings(ca_file=tls_node.ca_file))
        async with ReliablePublisher(plain, registry=CollectorRegistry()):
            theirs = [
                row
                for row in tls_node.tls_connections()
                if plain.connection_name in json.dumps(row["client_properties"])
            ]
        assert theirs and all(not row["peer_cert_subject"] for row in theirs), theirs

    async def test_a_certificate_from_another_ca_is_refused(self, tls_node: TLSNode) -> None:
        """The broker does not know the client's CA: a typed error naming the alert, no hang."""
        tls = TLSSettings(
            ca_file=tls_node.ca_file,
            cert_file=tls_node.stranger_cert,
            key_file=tls_node.stranger_key,
        )
        async with asyncio.timeout(60):
            # TLS 1.3: the broker's alert comes after the client's side of the
            # handshake, so the client reads the alert or, racing it, a reset. The
            # same settings with our CA's certificate connect (the test above).
            with pytest.raises(BrokerUnavailable, match=r"UNKNOWN_CA|reset") as caught:
                async with ReliablePublisher(
                    _settings(tls_node.url(), tls), registry=CollectorRegistry()
                ):
                    pass
        assert "guest:guest" not in str(caught.value)

    async def test_a_consumer_over_mutual_tls(self, tls_node: TLSNode, tls_queue: str) -> None:
        """The consumer (and the publisher it uses for retries) connects the same way."""
        tls = TLSSettings(
            ca_file=tls_node.ca_file, cert_file=tls_node.client_cert, key_file=tls_node.client_key
        )
        settings = _settings(tls_node.url(), tls)
        sent = await _publish(settings, tls_queue, 10)
        consumer = ReliableConsumer(settings, registry=CollectorRegistry(), retry_delays=(0.2,))
        seen: list[tuple[str, int]] = []

        @consumer.handler(tls_queue)
        async def handler(body: dict[str, int], delivery: Delivery) -> None:
            seen.append((delivery.message_id or "", delivery.attempt))
            if body["n"] == 0 and delivery.attempt == 1:
                raise RuntimeError("once: the retry copy goes out over TLS too")

        async with consumer:
            await wait_until(lambda: len(seen) == 11, timeout=30)
        assert {message_id for message_id, _ in seen} == sent
        assert sorted(attempt for _, attempt in seen) == [1] * 10 + [2]
