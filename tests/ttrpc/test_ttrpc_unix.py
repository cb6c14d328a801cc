"""serve_unix / connect_unix: the socket file's life and several clients at once."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest
from ttrpc_testing import async_test

from nri_accel.ttrpc import CallContext, Code, Connection, TtrpcError, connect_unix, serve_unix

SVC = "test.v1.Svc"


async def whoami(ctx: CallContext, payload: bytes) -> bytes:
    return payload + b":" + str(ctx.stream_id).encode()


@async_test
async def test_several_clients_are_served_independently(sock_path: Path) -> None:
    async with await serve_unix(sock_path, {SVC: {"Who": whoami}}) as server:
        clients = [await connect_unix(sock_path) for _ in range(3)]
        answers = await asyncio.gather(
            *(c.call(SVC, "Who", name) for c, name in zip(clients, [b"a", b"b", b"c"], strict=True))
        )
        # stream ids are per connection: each client's first call is stream 1
        assert answers == [b"a:1", b"b:1", b"c:1"]
        assert len(server.endpoints) == 3
        assert server.path == str(sock_path)
    for client in clients:
        await client.closed()
        assert client.is_closing()


@async_test
async def test_close_removes_the_socket_file(sock_path: Path) -> None:
    server = await serve_unix(sock_path, {SVC: {"Who": whoami}})
    assert sock_path.is_socket()
    server.close()
    await server.wait_closed()
    assert not sock_path.exists()
    with pytest.raises(TtrpcError) as info:
        await connect_unix(sock_path)
    assert info.value.code == Code.UNAVAILABLE
    assert str(sock_path) in info.value.message


@async_test
async def test_a_stale_socket_file_is_replaced(sock_path: Path) -> None:
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(sock_path))
    stale.close()  # the file stays, nobody listens
    async with await serve_unix(sock_path, {SVC: {"Who": whoami}}):
        client = await connect_unix(sock_path)
        assert await client.call(SVC, "Who", b"x") == b"x:1"


@async_test
async def test_a_client_can_serve_the_server_side_too(sock_path: Path) -> None:
    # connect_unix(services=...) answers requests the peer sends on the same socket.
    async def ping(ctx: CallContext, payload: bytes) -> bytes:
        return b"pong"

    async with await serve_unix(sock_path, {}) as server:
        client = await connect_unix(sock_path, {"Client": {"Ping": ping}})
        with pytest.raises(TtrpcError) as info:  # the server serves nothing...
            await client.call(SVC, "Who")
        assert info.value.code == Code.UNIMPLEMENTED
        (server_side,) = server.endpoints  # ...but may call the client
        assert await server_side.call("Client", "Ping") == b"pong"
        client.close()


@async_test
async def test_a_client_that_does_not_read_stops_the_server_reading_until_it_does(
    sock_path: Path,
) -> None:
    async def fill(ctx: CallContext, payload: bytes) -> bytes:
        return b"x" * 1000  # answers much larger than the requests

    requests = 20_000
    async with await serve_unix(sock_path, {SVC: {"Fill": fill}}):
        reader, writer = await asyncio.open_unix_connection(str(sock_path))
        peer = Connection()
        writer.write(b"".join(peer.request(SVC, "Fill", b"")[1] for _ in range(requests)))
        last = -1
        while writer.transport.get_write_buffer_size() not in (0, last):
            last = writer.transport.get_write_buffer_size()
            await asyncio.sleep(0.2)
        # The server stopped reading with most requests unread: 20 MB of answers would
        # otherwise wait in its memory for a client that does not read them.
        assert writer.transport.get_write_buffer_size() > 0
        answered = 0
        while answered < requests:
            data = await reader.read(1 << 16)
            assert data, "the server closed the connection"
            answered += len(peer.receive(data))
        writer.close()
        await writer.wait_closed()


@async_test
async def test_a_client_with_many_large_calls_in_flight_does_not_deadlock(
    sock_path: Path,
) -> None:
    async def echo(ctx: CallContext, payload: bytes) -> bytes:
        return payload

    payload = b"p" * (256 * 1024)
    async with await serve_unix(sock_path, {SVC: {"Echo": echo}}):
        client = await connect_unix(sock_path)
        # 25 MB each way at once: both write buffers overflow; the client keeps reading
        answers = await asyncio.gather(*(client.call(SVC, "Echo", payload) for _ in range(100)))
        assert answers == [payload] * 100
        client.close()
        await client.closed()
