"""An aio-pika connection for the one tool still written over aio-pika (``reliable-mq consume``).

Legacy: removed once that command is built on `reliable_mq.consumer.ReliableConsumer`.
Its frames are decoded as the consumer's are (`reliable_mq._amqp.inbound`), with
the same checks (`reliable_mq._amqp.hooks`).
"""

from __future__ import annotations

import aio_pika
import aio_pika.abc

from ..errors import BrokerUnavailable
from ..settings import ConnectionSettings, FastPath, redact_credentials
from . import hooks
from .faults import AMQP_ERRORS
from .inbound import take_frames

__all__ = ("connect_aio_pika",)


async def connect_aio_pika(
    settings: ConnectionSettings, name: str
) -> aio_pika.abc.AbstractConnection:
    """An aio-pika connection to the first of ``settings``' addresses that accepts one.

    Raises:
        BrokerUnavailable: no address accepted a connection.
        UnsupportedDependency: ``fast_path`` is ``on`` and a hook failed its check.
    """
    errors: list[str] = []
    for address in settings.addresses:
        url = address.url.update_query(heartbeat=str(settings.heartbeat), name=name)
        ssl_context = None
        if url.scheme == "amqps" and settings.tls is not None:
            ssl_context = settings.tls.ssl_context()
        try:
            connection = await aio_pika.connect(
                url,
                ssl_context=ssl_context,
                timeout=settings.connect_timeout,
                client_properties={"connection_name": name},
            )
        except AMQP_ERRORS as exc:
            text = redact_credentials(str(exc) or type(exc).__name__)
            errors.append(f"{address.redacted}: {type(exc).__name__}: {text}"[:300])
            continue
        mode = settings.fast_path
        transport = connection.transport
        try:
            if transport is not None and hooks.resolve(
                mode, hooks.verify() if mode is not FastPath.OFF else []
            ):
                receiver, failure = hooks.find_receiver(transport.connection)
                if failure is None:
                    take_frames(receiver)
                else:
                    hooks.resolve(mode, [failure])
        except BaseException:
            await connection.close()
            raise
        return connection
    raise BrokerUnavailable("no broker accepted a connection: " + "; ".join(errors))
