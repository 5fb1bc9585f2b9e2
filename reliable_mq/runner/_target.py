"""Find the consumer that ``reliable-mq run module:attribute`` names."""

from __future__ import annotations

import importlib
import re

from ..consumer import ReliableConsumer
from ..errors import InvalidTarget
from ..handlers import Router
from ..settings import redact_credentials

__all__ = ("load_consumer",)

_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def load_consumer(path: str) -> ReliableConsumer:
    """Import ``module:attribute`` and return a consumer with at least one handler.

    The attribute (dots allowed, ``module:app.consumer``) is a
    [ReliableConsumer][reliable_mq.consumer.ReliableConsumer], or a
    [Router][reliable_mq.handlers.Router]: then a consumer is built from the
    ``RELIABLE_MQ_*`` environment variables and the router's handlers.

    Raises:
        InvalidTarget: the path is malformed, cannot be imported, or names
            something else (the message says what was found).
        InvalidSettings: a Router's consumer settings from the environment are invalid.
    """
    if not isinstance(path, str) or not _PATH.match(path):
        raise InvalidTarget(
            f"{str(path)[:200]!r} is not an import path like 'myapp.consumers:consumer'"
        )
    module_name, _, attribute = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module_name.startswith(exc.name):
            raise InvalidTarget(
                f"cannot import {module_name!r}: no module named {exc.name!r} "
                "(run from the project folder, or pass --app-dir)"
            ) from None
        raise InvalidTarget(_failed_import(module_name, exc)) from exc
    except Exception as exc:  # the application's own import-time error
        raise InvalidTarget(_failed_import(module_name, exc)) from exc
    found: object = module
    for part in attribute.split("."):
        try:
            found = getattr(found, part)
        except AttributeError:
            raise InvalidTarget(f"{module_name!r} has no attribute {attribute!r}") from None
    return _as_consumer(found, path)


def _failed_import(module_name: str, exc: BaseException) -> str:
    text = redact_credentials(f"{type(exc).__name__}: {exc}")[:500]
    return f"importing {module_name!r} failed: {text}"


def _as_consumer(found: object, path: str) -> ReliableConsumer:
    if isinstance(found, ReliableConsumer):
        consumer = found
    elif isinstance(found, Router):
        consumer = ReliableConsumer()
        consumer.include_router(found)
    else:
        raise InvalidTarget(
            f"{path!r} is a {type(found).__name__}, not a ReliableConsumer or a Router"
        )
    if not consumer.handlers:
        raise InvalidTarget(f"{path!r} has no handlers registered")
    return consumer
