"""Time zones named the way Spark names them (region ids and fixed offsets)."""

from __future__ import annotations

import datetime as dt
import functools
import re
import zoneinfo

__all__ = ("zone_named",)

_OFFSET = re.compile(r"^(?:UTC|GMT)?([+-])(\d{1,2})(?::?(\d{2}))?$")


@functools.lru_cache(maxsize=64)
def zone_named(name: str) -> dt.tzinfo:
    """The zone ``spark.sql.session.timeZone`` or an Arrow type names.

    Accepts IANA region ids (``Europe/Berlin``), ``UTC``/``Z``, and fixed
    offsets (``+02:00``, ``-0530``, ``GMT+8``).

    Raises:
        ValueError: the name is none of those.
    """
    text = name.strip()
    if text in ("Z", "UTC", "GMT", "UT", "Etc/UTC"):
        return dt.UTC
    match = _OFFSET.match(text)
    if match is not None:
        sign, hours, minutes = match.groups()
        delta = dt.timedelta(hours=int(hours), minutes=int(minutes or 0))
        if delta > dt.timedelta(hours=18):
            raise ValueError(f"time zone offset {text!r} is out of range")
        return dt.timezone(-delta if sign == "-" else delta)
    try:
        return zoneinfo.ZoneInfo(text)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):
        raise ValueError(
            f"unknown time zone {text!r} (an IANA name such as 'Europe/Berlin', or an "
            "offset such as '+02:00')"
        ) from None
