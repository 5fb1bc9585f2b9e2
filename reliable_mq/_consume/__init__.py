"""The consumer's internals (`reliable_mq.consumer` is their public face).

Integrations never import the modules of this package; what they need of it is
named here, and only here:

* `copy_properties`: the properties of a copy of a received message, as the
  consumer's retry and DLQ copies carry them (``reliable-mq dlq move`` uses it).
"""

from .copies import copy_properties

__all__ = ("copy_properties",)
