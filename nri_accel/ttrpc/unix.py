"""Run ttrpc Endpoints directly on unix sockets: a listening server and a client connection.

Owns: serve_unix / UnixServer (listen on a path, one Endpoint per accepted
connection, all serving the same services) and connect_unix (one client Endpoint).
These are the thin asyncio.Protocol adapters a standalone user of the library needs;
a transport that multiplexes several ttrpc connections over one socket (NRI) drives
Endpoint itself. Imports asyncio, os and this package's endpoint, errors and flow.

A served connection stops reading while its write buffer is over the high-water
mark (flow.py): a client that does not read its answers cannot make the server hold
more than bounded memory. A client connection keeps reading (flow.py says why).
Closing a connection aborts it: what the peer has not taken yet is dropped, as
closing a Go net.Conn drops it, so a peer that does not read cannot keep a closed
connection (and its fd) open.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import cast

from .endpoint import Endpoint, Services
from .errors import Code, TtrpcError
from .flow import GatedReader


class _EndpointProtocol(GatedReader):
    """Feeds one socket's bytes to one Endpoint; the Endpoint writes to the socket.
    The decoder copies out what it keeps of each read (GatedReader's buffer is reused).
    `serving`: reading stops while the write buffer is full (the server side).
    """

    def __init__(
        self,
        services: Services | None,
        on_made: Callable[[Endpoint], object] | None = None,
        on_lost: Callable[[Endpoint], object] | None = None,
        *,
        serving: bool,
    ) -> None:
        super().__init__(serving=serving)
        self._services = services
        self._on_made = on_made
        self._on_lost = on_lost
        self.endpoint: Endpoint | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        transport = cast(asyncio.Transport, transport)
        self.endpoint = Endpoint(transport.write, self._services, on_close=transport.abort)
        if self._on_made is not None:
            self._on_made(self.endpoint)

    def data_received(self, data: memoryview) -> None:
        assert self.endpoint is not None
        self.endpoint.data_received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        assert self.endpoint is not None
        self.endpoint.connection_lost(exc)
        if self._on_lost is not None:
            self._on_lost(self.endpoint)


class UnixServer:
    """A unix socket listening at `path`, serving `services` on every connection.

    close() stops listening, closes every connection (their running handlers are
    cancelled) and removes the socket file it created; await wait_closed() for the
    end. Also an async context manager doing both.
    """

    def __init__(self, path: str | os.PathLike[str], services: Services) -> None:
        self._path = os.fspath(path)
        self._services = services
        self._endpoints: set[Endpoint] = set()
        self._server: asyncio.Server | None = None
        self._inode = 0
        self._closing = False
        self._closed: list[Endpoint] = []  # endpoints close() shut, for wait_closed()

    @property
    def path(self) -> str:
        return self._path

    @property
    def endpoints(self) -> frozenset[Endpoint]:
        """The connections open now."""
        return frozenset(self._endpoints)

    async def start(self) -> None:
        """Bind and listen (a stale socket file at the path is replaced)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(self._new_protocol, self._path)
        self._inode = os.stat(self._path).st_ino

    def close(self) -> None:
        if self._server is None or self._closing:
            return
        self._closing = True
        self._server.close()
        self._closed = list(self._endpoints)
        for endpoint in self._closed:
            endpoint.close()
        try:
            if os.stat(self._path).st_ino == self._inode:
                os.unlink(self._path)
        except FileNotFoundError:
            pass

    async def wait_closed(self) -> None:
        if self._server is not None:
            await self._server.wait_closed()
        for endpoint in self._closed:
            await endpoint.closed()

    async def __aenter__(self) -> UnixServer:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()
        await self.wait_closed()

    def _new_protocol(self) -> _EndpointProtocol:
        return _EndpointProtocol(self._services, self._accepted, self._endpoints.discard,
                                 serving=True)

    def _accepted(self, endpoint: Endpoint) -> None:
        if self._closing:  # accepted just before close(): not served
            self._closed.append(endpoint)
            endpoint.close()
        else:
            self._endpoints.add(endpoint)


async def serve_unix(path: str | os.PathLike[str], services: Services) -> UnixServer:
    """Listen on the unix socket `path` and serve `services` on every connection."""
    server = UnixServer(path, services)
    await server.start()
    return server


async def connect_unix(path: str | os.PathLike[str], services: Services | None = None) -> Endpoint:
    """Connect to the ttrpc server at the unix socket `path`; return the client Endpoint.

    `services`, when given, are served to the peer on the same connection. Raises
    TtrpcError(UNAVAILABLE) when nothing accepts connections there. Close it with
    close() and `await endpoint.closed()`.
    """
    loop = asyncio.get_running_loop()
    try:
        _, protocol = await loop.create_unix_connection(
            lambda: _EndpointProtocol(services, serving=False), os.fspath(path)
        )
    except OSError as exc:
        raise TtrpcError(Code.UNAVAILABLE, f"cannot connect to {os.fspath(path)}: {exc}") from exc
    assert protocol.endpoint is not None
    return protocol.endpoint
