"""The AMQP seam: the only package that imports aiormq, pamqp or aio-pika.

The rest of reliable_mq talks to RabbitMQ through this small interface of its
own (httpx's transport layer is the model):

* `open_link` opens one connection, a `Link`, and decides its path (see
  `reliable_mq._amqp.hooks`): the fast paths below aiormq's public API when
  every hook into aiormq's and pamqp's internals verifies, else the plain path
  through aiormq's public API (with one warning, or `UnsupportedDependency`
  under ``fast_path="on"``). `Link.wait_closed` says how it ended (`LinkEnd`).
* `Link.confirm_channel`: the publisher's `ConfirmChannel` (`ConfirmChannel.send`
  a `Publish`; `ConfirmEvents` hears the confirms, returns and the close).
* `Link.consume_channel`: a consumer's `ConsumeChannel` (qos, consume with an
  `OnDelivery`, ack, nack, cancel, close).
* `Link.channel`: a `Channel` for topology and tools (declare, delete,
  ``basic.get`` as `Got`, settle); `user_channel` wraps an application's
  aio-pika channel the same way.
* `classify` is the one error map: whatever a call here raises (`AMQP_ERRORS`)
  becomes a `Fault` of a `FaultKind`; `inequivalence` reads the broker's 406
  refusal of a redeclare (the argument that differs and the queue's value).
* `reliable_mq._amqp.wire` encodes what we publish; `reliable_mq._amqp.inbound`
  decodes what we consume (`Undecodable`: what pamqp could not decode).
"""

from pamqp.commands import Basic

from .channels import (
    Channel,
    ChannelOpener,
    Got,
    QueueInfo,
    UserChannel,
    UserConnection,
    is_user_channel,
    user_channel,
    user_connection,
)
from .confirm import ConfirmChannel, ConfirmEvents, Publish
from .consume import ConsumeChannel
from .faults import AMQP_ERRORS, Fault, FaultKind, Inequivalence, classify, inequivalence
from .inbound import OnDelivery, Undecodable
from .link import Link, LinkEnd, open_link

__all__ = (
    "AMQP_ERRORS",
    "Basic",
    "Channel",
    "ChannelOpener",
    "ConfirmChannel",
    "ConfirmEvents",
    "ConsumeChannel",
    "Fault",
    "FaultKind",
    "Got",
    "Inequivalence",
    "Link",
    "LinkEnd",
    "OnDelivery",
    "Publish",
    "QueueInfo",
    "Undecodable",
    "UserChannel",
    "UserConnection",
    "classify",
    "inequivalence",
    "is_user_channel",
    "open_link",
    "user_channel",
    "user_connection",
)
