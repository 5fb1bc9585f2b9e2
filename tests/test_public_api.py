"""The public surface stays small, sorted and complete."""

from __future__ import annotations

import importlib
import pkgutil

import reliable_mq


def test_all_is_sorted_and_complete() -> None:
    names = reliable_mq.__all__
    assert isinstance(names, tuple)
    assert list(names) == sorted(names)
    for name in names:
        assert hasattr(reliable_mq, name), name


def test_every_public_module_declares_a_tuple_all() -> None:
    for module_info in pkgutil.walk_packages(reliable_mq.__path__, "reliable_mq."):
        if module_info.name.rsplit(".", 1)[-1].startswith("_") or module_info.name.endswith(
            "spark"
        ):
            continue
        module = importlib.import_module(module_info.name)
        assert isinstance(getattr(module, "__all__", None), tuple), module_info.name


def test_every_error_derives_from_the_root() -> None:
    from reliable_mq import errors

    for name in errors.__all__:
        assert issubclass(getattr(errors, name), reliable_mq.ReliableMQError), name


def test_importing_configures_no_logging() -> None:
    import logging

    import structlog

    importlib.reload(reliable_mq)
    assert not logging.getLogger("reliable_mq").handlers
    assert not structlog.is_configured()


def test_errors_pickle_with_their_attributes() -> None:
    import pickle

    error = reliable_mq.PublishUnroutable(
        message_id="m1",
        attempts=1,
        exchange="x",
        routing_key="k",
        reply_code=312,
        reply_text="NO_ROUTE",
    )
    restored = pickle.loads(pickle.dumps(error))
    assert type(restored) is reliable_mq.PublishUnroutable
    assert (restored.message_id, restored.reply_code, str(restored)) == ("m1", 312, str(error))
