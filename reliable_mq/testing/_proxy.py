"""A small asyncio TCP proxy for fault injection.

`TCPProxy` sits between a client and a broker and can cut every connection at
once, silently drop traffic (a blackhole), hold traffic (a stall), or refuse
new connections. It uses asyncio protocols, so it adds little overhead and can
carry tens of thousands of AMQP frames per second. It also counts what it
forwards in each direction (`TCPProxy.traffic`), so a test can see how many
reads a client's writes arrived in.
"""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import NamedTuple, TypeVar, cast

__all__ = ("TCPProxy", "Traffic")

_ProxyT = TypeVar("_ProxyT", bound="TCPProxy")


class Traffic(NamedTuple):
    """What a `TCPProxy` forwarded so far, per direction, over all its connections.

    A *read* is one chunk the proxy received from a socket and forwarded. The
    kernel may join several writes of the sender into one read, or split a
    large one, so reads only approximate the sender's writes; bytes are exact.
    """

    to_upstream_reads: int
    """Chunks read from clients and forwarded to the upstream (the broker)."""
    to_upstream_bytes: int
    """Bytes forwarded from clients to the upstream."""
    to_client_reads: int
    """Chunks read from the upstream and forwarded to clients."""
    to_client_bytes: int
    """Bytes forwarded from the upstream to clients."""


class _Pair:
    """One client connection and its upstream connection."""

    __slots__ = ("client", "connect_task", "upstream")

    def __init__(self) -> None:
        self.client: _Endpoint | None = None
        self.upstream: _Endpoint | None = None
        self.connect_task: asyncio.Task[None] | None = None

    def abort(self) -> None:
        """Abort both sides immediately and stop a pending upstream connect."""
        if self.connect_task is not None:
            self.connect_task.cancel()
        for side in (self.client, self.upstream):
            if side is not None and side.transport is not None:
                side.transport.abort()

    @property
    def finished(self) -> bool:
        """Whether both sides are gone and no upstream connect is pending."""
        client_done = self.client is None or self.client.lost
        upstream_done = self.upstream is None or self.upstream.lost
        return client_done and upstream_done and self.connect_task is None


class _Endpoint(asyncio.Protocol):
    """One side of a pair: forwards what it reads to its peer's transport."""

    __slots__ = ("_pair", "_peer_full", "_proxy", "eof", "is_client", "lost", "peer", "transport")

    def __init__(self, proxy: TCPProxy, pair: _Pair, *, is_client: bool) -> None:
        self._proxy = proxy
        self._pair = pair
        self.is_client = is_client
        self.transport: asyncio.Transport | None = None
        self.peer: _Endpoint | None = None
        self.lost = False
        self.eof = False
        self._peer_full = False

    # -- reading control -------------------------------------------------

    def update_reading(self) -> None:
        """Read only while linked, not stalled and the peer can take more bytes."""
        transport = self.transport
        if transport is None or transport.is_closing() or self.eof:
            return
        if self.peer is None or self._peer_full or self._proxy._stalled:
            transport.pause_reading()
        else:
            transport.resume_reading()

    # -- asyncio.Protocol ------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        if self.is_client:
            self._proxy._client_connected(self)
        else:
            self._proxy._upstream_connected(self)

    def data_received(self, data: bytes) -> None:
        if self._proxy._blackhole:
            return
        peer = self.peer
        if peer is None or peer.transport is None:
            return
        if peer.lost:
            # The peer vanished during a blackhole: answer like a reset would.
            if self.transport is not None:
                self.transport.abort()
        elif not peer.transport.is_closing():
            peer.transport.write(data)
            proxy = self._proxy
            if self.is_client:
                proxy._up_reads += 1
                proxy._up_bytes += len(data)
            else:
                proxy._down_reads += 1
                proxy._down_bytes += len(data)

    def eof_received(self) -> bool:
        self.eof = True
        if self._proxy._blackhole:
            return False  # the FIN is lost too: close this side only
        peer = self.peer
        if peer is None or peer.transport is None or peer.transport.is_closing():
            return False
        if peer.eof:
            # Both directions are finished: close both sides.
            peer.transport.close()
            return False
        if peer.transport.can_write_eof():
            peer.transport.write_eof()
            return True  # keep the other direction open (half-close)
        peer.transport.close()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        peer = self.peer
        if self._proxy._blackhole:
            pass  # the peer learns nothing until the blackhole lifts
        elif peer is not None and peer.transport is not None and not peer.lost:
            if exc is None:
                peer.transport.close()  # flushes what is buffered first
            else:
                peer.transport.abort()
        if self.is_client and self._pair.connect_task is not None:
            self._pair.connect_task.cancel()
        self._proxy._forget(self._pair)

    def pause_writing(self) -> None:
        # Our transport's write buffer is full: stop reading from the peer.
        peer = self.peer
        if peer is not None:
            peer._peer_full = True
            peer.update_reading()

    def resume_writing(self) -> None:
        peer = self.peer
        if peer is not None:
            peer._peer_full = False
            peer.update_reading()


class TCPProxy:
    """A TCP proxy that can cut, blackhole, stall or refuse connections.

    Example:
        async with TCPProxy("127.0.0.1", 5672) as proxy:
            connection = await aio_pika.connect(f"amqp://guest:guest@127.0.0.1:{proxy.port}/")
            await proxy.cut()  # the client sees its connection drop

    Args:
        target_host: Host to forward connections to.
        target_port: Port to forward connections to.
        listen_host: Address to listen on.
        listen_port: Port to listen on; 0 picks a free port (see `port`).
    """

    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
    ) -> None:
        self.target_host = target_host
        self.target_port = target_port
        self.listen_host = listen_host
        self._listen_port = listen_port
        self._server: asyncio.AbstractServer | None = None
        self._pairs: set[_Pair] = set()
        self._blackhole = False
        self._stalled = False
        self._refuse = False
        self.connections_total = 0
        """Client connections accepted and proxied so far (refused ones excluded)."""
        self.refused_total = 0
        """Client connections closed on arrival because refusing was on."""
        self._up_reads = self._up_bytes = self._down_reads = self._down_bytes = 0

    # -- lifecycle -------------------------------------------------------

    async def start(self) -> None:
        """Start listening.

        After `close()` the proxy can be started again; it then reuses the
        port it had, so clients can reconnect to the same address.

        Raises:
            RuntimeError: If the proxy is already running.
        """
        if self._server is not None:
            raise RuntimeError("TCPProxy is already running")
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            self._new_client, self.listen_host, self._listen_port, reuse_address=True
        )
        self._listen_port = server.sockets[0].getsockname()[1]
        self._server = server

    async def close(self) -> None:
        """Stop listening and abort every connection pair. Safe to call twice."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        pairs = list(self._pairs)
        tasks = [p.connect_task for p in pairs if p.connect_task is not None]
        for pair in pairs:
            pair.abort()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if server is not None:
            await server.wait_closed()
        await asyncio.sleep(0)  # let the aborted transports report connection_lost

    async def __aenter__(self: _ProxyT) -> _ProxyT:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # -- addresses and counters -----------------------------------------

    @property
    def port(self) -> int:
        """The port the proxy listens on (known once started).

        Raises:
            RuntimeError: If `listen_port` was 0 and the proxy was never started.
        """
        if self._listen_port == 0:
            raise RuntimeError("TCPProxy has not been started yet")
        return self._listen_port

    @property
    def address(self) -> tuple[str, int]:
        """The (host, port) the proxy listens on."""
        return self.listen_host, self.port

    @property
    def active_connections(self) -> int:
        """Connection pairs currently open (or still connecting upstream)."""
        return len(self._pairs)

    @property
    def traffic(self) -> Traffic:
        """Reads and bytes forwarded so far in each direction (a snapshot).

        Blackholed bytes are not counted: they were not forwarded.
        """
        return Traffic(self._up_reads, self._up_bytes, self._down_reads, self._down_bytes)

    @property
    def is_running(self) -> bool:
        """Whether the proxy is listening."""
        return self._server is not None

    @property
    def blackhole(self) -> bool:
        """Whether traffic is currently being discarded."""
        return self._blackhole

    @property
    def stalled(self) -> bool:
        """Whether traffic is currently being held."""
        return self._stalled

    @property
    def refusing(self) -> bool:
        """Whether new connections are currently refused."""
        return self._refuse

    # -- faults ----------------------------------------------------------

    async def cut(self) -> int:
        """Abort every current connection pair on both sides at once.

        Both the client and the upstream see a reset. New connections are
        still accepted afterwards.

        Returns:
            How many pairs were cut.
        """
        pairs = list(self._pairs)
        for pair in pairs:
            pair.abort()
        await asyncio.sleep(0)  # let the aborted transports report connection_lost
        return len(pairs)

    def set_blackhole(self, enabled: bool) -> None:
        """Discard all bytes in both directions while enabled.

        Connections stay open and new ones are accepted (and blackholed too),
        like a stalled network that only heartbeats detect. Closes are not
        passed on either: if one side gives up (say the broker after missed
        heartbeats), the other side only finds out through its own
        heartbeats, or gets a reset once the blackhole is lifted.

        The discarded bytes are gone for good: a connection that lost bytes
        is usually unusable afterwards, so expect clients to detect it and
        reconnect. Use `set_stall` to hold bytes instead.
        """
        self._blackhole = enabled
        if enabled:
            return
        for pair in list(self._pairs):
            for side, peer in ((pair.client, pair.upstream), (pair.upstream, pair.client)):
                if (
                    side is not None
                    and side.lost
                    and peer is not None
                    and not peer.lost
                    and peer.transport is not None
                ):
                    peer.transport.abort()

    def set_stall(self, enabled: bool) -> None:
        """Stop forwarding in both directions while enabled, without losing bytes.

        The proxy stops reading, so the kernel buffers fill and the senders
        block, as on a network that stops and recovers. Held bytes are
        delivered once the stall ends, so a connection whose heartbeats have
        not timed out carries on unharmed.
        """
        self._stalled = enabled
        for pair in list(self._pairs):
            for side in (pair.client, pair.upstream):
                if side is not None:
                    side.update_reading()

    def set_refuse(self, enabled: bool) -> None:
        """Close new incoming connections on arrival while enabled.

        Simulates an unreachable broker. Existing connections are untouched;
        call `cut()` as well to drop them.
        """
        self._refuse = enabled

    # -- internals -------------------------------------------------------

    def _new_client(self) -> _Endpoint:
        pair = _Pair()
        endpoint = _Endpoint(self, pair, is_client=True)
        pair.client = endpoint
        return endpoint

    def _client_connected(self, client: _Endpoint) -> None:
        transport = client.transport
        assert transport is not None
        if self._refuse or self._server is None:
            self.refused_total += 1
            client.lost = True  # never registered: nothing to forget later
            transport.abort()
            return
        self.connections_total += 1
        pair = client._pair
        self._pairs.add(pair)
        transport.pause_reading()  # until the upstream side is connected
        pair.connect_task = asyncio.get_running_loop().create_task(self._connect_upstream(pair))

    async def _connect_upstream(self, pair: _Pair) -> None:
        loop = asyncio.get_running_loop()
        try:
            await loop.create_connection(
                lambda: _Endpoint(self, pair, is_client=False), self.target_host, self.target_port
            )
        except Exception:  # unreachable target, DNS failure, ...: drop the client
            client = pair.client
            if client is not None and client.transport is not None:
                client.transport.abort()
        finally:
            pair.connect_task = None
            self._forget(pair)

    def _upstream_connected(self, upstream: _Endpoint) -> None:
        pair = upstream._pair
        client = pair.client
        transport = upstream.transport
        assert client is not None and transport is not None
        pair.upstream = upstream
        if client.lost or client.transport is None or client.transport.is_closing():
            transport.abort()
            return
        upstream.peer = client
        client.peer = upstream
        upstream.update_reading()
        client.update_reading()

    def _forget(self, pair: _Pair) -> None:
        if pair.finished:
            self._pairs.discard(pair)

    def __repr__(self) -> str:
        listen = f"{self.listen_host}:{self._listen_port or '?'}"
        return (
            f"<TCPProxy {listen} -> {self.target_host}:{self.target_port}"
            f" active={self.active_connections} total={self.connections_total}>"
        )
