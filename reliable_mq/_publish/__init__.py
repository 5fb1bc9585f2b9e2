"""The publisher's internals (`reliable_mq.publisher` is their public face).

Integrations (the CLI, the outbox, the sync facade...) never import the modules
of this package; what they need of it is named here, and only here:

* `check_timeout`: a timeout as the publisher accepts it (finite, positive);
* `encode_headers`: headers as they go on the wire (raises on what AMQP cannot carry).
"""

from .._amqp.wire import check_timeout, encode_headers

__all__ = ("check_timeout", "encode_headers")
