"""A store in Redis, shared by every consumer process on every host.

Each id is one key, ``<prefix><message_id>``, holding ``claimed:<owner>`` with
the lease as its TTL, or ``done`` with the retention window as its TTL, so
Redis itself forgets expired leases and old ids. Claim and release are Lua
scripts: one round trip, atomic against every other client.

Socket timeouts are short on purpose: an unreachable Redis must surface as
[`DedupStoreUnavailable`][reliable_mq.dedup.DedupStoreUnavailable] quickly (the consumer then
leaves the message unacked), not stall deliveries. Install with
the ``redis`` extra (from a clone: ``pip install '.[redis]'``).
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

try:
    import redis.asyncio as aioredis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff
    from redis.exceptions import RedisError
except ImportError as exc:  # pragma: no cover - exercised by a test with redis hidden
    from .._extras import missing_extra

    raise ImportError(missing_extra("RedisDedupStore needs the redis package", "redis")) from exc

from .base import ClaimResult, DedupStoreUnavailable

__all__ = ("RedisDedupStore",)

# KEYS[1] = key; ARGV[1] = 'claimed:<owner>', ARGV[2] = lease in ms.
# Returns 0 CLAIMED, 1 DONE, 2 BUSY.
_CLAIM_LUA = """
local state = redis.call('GET', KEYS[1])
if not state then
    redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
    return 0
end
if state == 'done' then
    return 1
end
return 2
"""
# KEYS[1] = key; ARGV[1] = 'claimed:<owner>'. Deletes only the owner's own claim.
_RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('DEL', KEYS[1])
end
return 0
"""
_RESULTS = (ClaimResult.CLAIMED, ClaimResult.DONE, ClaimResult.BUSY)


class RedisDedupStore:
    """A [`DedupStore`][reliable_mq.dedup.DedupStore] in Redis.

    Args:
        url: the Redis URL (``redis://``, ``rediss://`` or ``unix://``).
        prefix: put before every message id to form its key.
        retention: seconds a done id is remembered.
        socket_timeout: seconds to wait for a reply before the call fails.
        connect_timeout: seconds to wait for a connection before the call fails.
    """

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        prefix: str = "reliable_mq:dedup:",
        retention: float = 3600,
        socket_timeout: float = 2.0,
        connect_timeout: float = 2.0,
    ) -> None:
        if retention <= 0:
            raise ValueError("retention must be positive")
        self.prefix = prefix
        self.retention = float(retention)
        self._retention_ms = max(1, round(retention * 1000))
        # One immediate retry replaces a pooled connection that died meanwhile
        # (a Redis restart); more would only delay the "unavailable" answer.
        self._client: aioredis.Redis = aioredis.Redis.from_url(
            url,
            socket_timeout=socket_timeout,
            socket_connect_timeout=connect_timeout,
            retry=Retry(NoBackoff(), 1),
        )
        self._claim_script = self._client.register_script(_CLAIM_LUA)
        self._release_script = self._client.register_script(_RELEASE_LUA)
        self._closed = False

    async def claim(self, message_id: str, *, owner: str, lease: float) -> ClaimResult:
        """Claim ``message_id`` (see `DedupStore.claim()`)."""
        if lease <= 0:
            raise ValueError("lease must be positive")
        self._check_open()
        lease_ms = max(1, round(lease * 1000))
        code = await self._run(
            self._claim_script(keys=[self.prefix + message_id], args=[f"claimed:{owner}", lease_ms])
        )
        return _RESULTS[int(code)]

    async def complete(self, message_id: str, *, owner: str) -> None:
        """Mark ``message_id`` done (see `DedupStore.complete()`)."""
        self._check_open()
        await self._run(self._client.set(self.prefix + message_id, "done", px=self._retention_ms))

    async def release(self, message_id: str, *, owner: str) -> None:
        """Drop ``owner``'s claim (see `DedupStore.release()`)."""
        self._check_open()
        await self._run(
            self._release_script(keys=[self.prefix + message_id], args=[f"claimed:{owner}"])
        )

    async def close(self) -> None:
        """Close the connection pool."""
        if not self._closed:
            self._closed = True
            await self._client.aclose()

    def _check_open(self) -> None:
        if self._closed:
            raise DedupStoreUnavailable("the dedup store is closed")

    @staticmethod
    async def _run(call: Awaitable[Any]) -> Any:
        try:
            return await call
        except (RedisError, OSError) as exc:
            raise DedupStoreUnavailable(f"Redis dedup store: {exc}") from exc
