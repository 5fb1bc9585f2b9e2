"""TLS against a real listener: a private RabbitMQ node with certificates made in the test.

One node per module (``listeners.ssl.default``) with a private CA from
``trustme``. The node asks every TLS client for a certificate
(``fail_if_no_peer_cert``), so the working case is mutual TLS, and a client
without a certificate is refused. The server certificate names ``localhost``
only, so connecting to ``127.0.0.1`` is a hostname mismatch.
"""

from __future__ import annotations

import os
import secrets
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import trustme
from prometheus_client import CollectorRegistry

from reliable_mq import (
    BrokerUnavailable,
    ConnectionSettings,
    ReliablePublisher,
    TLSSettings,
    declare_topology,
)
from reliable_mq.topology import QueueTopology, delete_topology
from tests.support.private_node import PrivateBroker, find_rabbitmq_sbin, free_port

pytestmark = [pytest.mark.private_broker, pytest.mark.timeout(180)]


@dataclass(frozen=True)
class TLSNode:
    port: int
    ca_file: str
    client_cert: str
    client_key: str
    plain_url: str

    def url(self, host: str = "localhost") -> str:
        return f"amqps://guest:guest@{host}:{self.port}/"


@pytest.fixture(scope="module")
def tls_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TLSNode]:
    if find_rabbitmq_sbin() is None:
        if os.environ.get("CI"):
            pytest.fail("RabbitMQ is not installed: the TLS tests need a private node")
        pytest.skip("RabbitMQ is not installed")
    certs = tmp_path_factory.mktemp("certs")
    ca = trustme.CA()
    server = ca.issue_cert("localhost")
    client = ca.issue_cert("reliable-mq-test-client")
    ca.cert_pem.write_to_path(str(certs / "ca.pem"))
    server.private_key_and_cert_chain_pem.write_to_path(str(certs / "server.pem"))
    client.cert_chain_pems[0].write_to_path(str(certs / "client.pem"))
    client.private_key_pem.write_to_path(str(certs / "client.key"))
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
            "ssl_options.fail_if_no_peer_cert = true\n"
        )
    try:
        node.start()
        yield TLSNode(
            port=port,
            ca_file=str(certs / "ca.pem"),
            client_cert=str(certs / "client.pem"),
            client_key=str(certs / "client.key"),
            plain_url=node.url,
        )
    finally:
        node.cleanup()


def _settings(url: str, tls: TLSSettings | None) -> ConnectionSettings:
    return ConnectionSettings(
        url=url,  # type: ignore[arg-type]
        tls=tls,
        connect_timeout=10,
        connection_name=f"tls-{uuid.uuid4().hex[:6]}",
    )


async def test_mutual_tls_with_a_verified_private_ca(tls_node: TLSNode) -> None:
    """CA verified, hostname checked, client certificate presented: messages are confirmed."""
    tls = TLSSettings(
        ca_file=tls_node.ca_file, cert_file=tls_node.client_cert, key_file=tls_node.client_key
    )
    settings = _settings(tls_node.url(), tls)
    queue = f"tls-{uuid.uuid4().hex[:8]}"
    await declare_topology(settings, queue)
    try:
        async with ReliablePublisher(settings, registry=CollectorRegistry()) as publisher:
            results = [await publisher.publish({"n": n}, routing_key=queue) for n in range(20)]
        assert len({r.message_id for r in results}) == 20
    finally:
        import aio_pika

        connection = await aio_pika.connect(tls_node.plain_url)
        async with connection:
            await delete_topology(await connection.channel(), QueueTopology(queue))


async def test_the_system_trust_store_rejects_a_private_ca(tls_node: TLSNode) -> None:
    """No ca_file: the system store does not know the private CA; a typed error says so."""
    tls = TLSSettings(cert_file=tls_node.client_cert, key_file=tls_node.client_key)
    for settings in (_settings(tls_node.url(), tls), _settings(tls_node.url(), None)):
        with pytest.raises(BrokerUnavailable, match="CERTIFICATE_VERIFY_FAILED") as caught:
            async with ReliablePublisher(settings, registry=CollectorRegistry()):
                pass
        assert "guest:guest" not in str(caught.value)


async def test_a_hostname_mismatch_is_rejected(tls_node: TLSNode) -> None:
    """The certificate names localhost; 127.0.0.1 is not it."""
    tls = TLSSettings(
        ca_file=tls_node.ca_file, cert_file=tls_node.client_cert, key_file=tls_node.client_key
    )
    with pytest.raises(BrokerUnavailable, match=r"CERTIFICATE_VERIFY_FAILED.*mismatch"):
        async with ReliablePublisher(
            _settings(tls_node.url("127.0.0.1"), tls), registry=CollectorRegistry()
        ):
            pass


async def test_without_a_client_certificate_the_broker_refuses(tls_node: TLSNode) -> None:
    """Mutual TLS is enforced: no client certificate, no connection (a typed error, no hang)."""
    with pytest.raises(BrokerUnavailable):
        async with ReliablePublisher(
            _settings(tls_node.url(), TLSSettings(ca_file=tls_node.ca_file)),
            registry=CollectorRegistry(),
        ):
            pass
