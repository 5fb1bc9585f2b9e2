"""The install hint an optional module raises when its extra is missing.

No release is on the package index yet, so the hint says how to install the
extra from a clone or from a wheel built with ``python -m build`` (the README's
Install section), never by the package's name.
"""

from __future__ import annotations

from ._version import __version__

__all__ = ("missing_extra",)


def missing_extra(what: str, extra: str) -> str:
    """The message for an ``ImportError`` raised when ``extra`` is not installed.

    Args:
        what: what is missing and what needs it, e.g. ``"RedisDedupStore needs
            the redis package"``.
        extra: the name of the extra in ``pyproject.toml`` (``"redis"``).
    """
    wheel = f"reliable_mq-{__version__}-py3-none-any.whl"
    return (
        f"{what}: install reliable_mq with the '{extra}' extra, from a clone "
        f"with pip install '.[{extra}]' or from a built wheel with "
        f"pip install '{wheel}[{extra}]'"
    )
