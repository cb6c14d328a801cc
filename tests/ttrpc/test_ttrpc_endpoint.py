"""Endpoint behaviour over a real unix socket (and an in-memory transport where said)."""

from __future__ import annotations

import asyncio
import gc
import struct
import warnings
from pathlib import Path
from typing import Any

import pytest
from ttrpc_testing import RawPeer, async_test, memory_pair

from nri_accel.ttrpc import (
    MAX_MESSAGE_SIZE,
    CallContext,
    Code,
    Connection,
    Endpoint,
    FrameType,
    RequestReceived,
    ResponseReceived,
    Services,
    TtrpcError,
    connect_unix,
    encode_frame,
    serve_unix,
)

SVC = "test.v1.Svc"


async def echo(ctx: CallContext, payload: bytes) -> bytes:
    return payload


async def call_error(endpoint: Endpoint, method: str, payload: bytes = b"", **kw) -> TtrpcError:
    with pytest.raises(TtrpcError) as info:
        await endpoint.call(SVC, method, payload, **kw)
    return info.value


class Blocker:
    """A handler that blocks until released, recording that it started and how it ended."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.cancelled = asyncio.Event()

    async def __call__(self, ctx: CallContext, payload: bytes) -> bytes:
        self.started.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return b"released"


@async_test
async def test_call_returns_the_answer_and_the_handler_sees_its_context(sock_path: Path) -> None:
    seen: list[CallContext] = []

    async def record(ctx: CallContext, payload: bytes) -> bytes:
        seen.append(ctx)
        return payload[::-1]

    async with await serve_unix(sock_path, {SVC: {"Record": record}}):
        client = await connect_unix(sock_path)
        loop = asyncio.get_running_loop()
        before = loop.time()
        md = [("containerd-namespace-ttrpc", "k8s.io"), ("k", "a"), ("k", "b")]
        assert await client.call(SVC, "Record", b"abc", timeout=30.0, metadata=md) == b"cba"
        assert await client.call(SVC, "Record", b"") == b""
        after = loop.time()
        client.close()
        await client.closed()

    first, second = seen
    assert (first.service, first.method, first.stream_id) == (SVC, "Record", 1)
    assert first.metadata == tuple(md)
    assert first.deadline is not None and before + 30.0 <= first.deadline + 1e-3
    assert first.deadline <= after + 30.0
    assert (second.stream_id, second.metadata, second.deadline) == (3, (), None)


@async_test
async def test_concurrent_calls_are_all_in_flight_and_matched_by_stream_id(sock_path: Path) -> None:
    n = 32
    arrived = 0
    all_arrived = asyncio.Event()

    async def gather_then_answer(ctx: CallContext, payload: bytes) -> bytes:
        nonlocal arrived
        arrived += 1
        if arrived == n:
            all_arrived.set()
        await all_arrived.wait()  # only returns if every call runs at the same time
        # answer in the reverse order of arrival
        for _ in range(n - int(payload)):
            await asyncio.sleep(0)
        return b"re:" + payload

    async with await serve_unix(sock_path, {SVC: {"M": gather_then_answer}}):
        client = await connect_unix(sock_path)
        answers = await asyncio.gather(
            *(client.call(SVC, "M", str(i).encode()) for i in range(n))
        )
        assert answers == [b"re:" + str(i).encode() for i in range(n)]
        client.close()


@async_test
async def test_unknown_service_and_method_are_unimplemented_by_name(sock_path: Path) -> None:
    async with await serve_unix(sock_path, {SVC: {"Echo": echo}}):
        client = await connect_unix(sock_path)
        with pytest.raises(TtrpcError) as info:
            await client.call("no.such.Service", "Echo")
        assert info.value.code == Code.UNIMPLEMENTED
        assert "no.such.Service" in info.value.message
        err = await call_error(client, "Nope")
        assert err.code == Code.UNIMPLEMENTED
        assert "'Nope'" in err.message and SVC in err.message
        assert await client.call(SVC, "Echo", b"still serving") == b"still serving"
        client.close()


@async_test
async def test_handler_errors_become_statuses_and_never_close_the_connection(
    sock_path: Path,
) -> None:
    async def refuse(ctx: CallContext, payload: bytes) -> bytes:
        raise TtrpcError(Code.FAILED_PRECONDITION, "annotation x: bad value")

    async def crash(ctx: CallContext, payload: bytes) -> bytes:
        raise KeyError("gpu9")

    async def wrong_type(ctx: CallContext, payload: bytes) -> bytes:
        return "text"  # type: ignore[return-value]

    async def self_cancel(ctx: CallContext, payload: bytes) -> bytes:
        raise asyncio.CancelledError

    services: Services = {
        SVC: {
            "Refuse": refuse,
            "Crash": crash,
            "WrongType": wrong_type,
            "SelfCancel": self_cancel,
            "Echo": echo,
        }
    }
    async with await serve_unix(sock_path, services):
        client = await connect_unix(sock_path)
        err = await call_error(client, "Refuse")
        assert (err.code, err.message) == (Code.FAILED_PRECONDITION, "annotation x: bad value")
        err = await call_error(client, "Crash")
        assert (err.code, err.message) == (Code.UNKNOWN, "KeyError: 'gpu9'")
        err = await call_error(client, "WrongType")
        assert err.code == Code.UNKNOWN
        assert "returned str, not bytes" in err.message
        err = await call_error(client, "SelfCancel")
        assert err.code == Code.CANCELLED
        assert await client.call(SVC, "Echo", b"ok") == b"ok"
        client.close()


@async_test
async def test_request_deadline_cancels_the_handler_and_answers_deadline_exceeded(
    sock_path: Path,
) -> None:
    blocker = Blocker()
    async with await serve_unix(sock_path, {SVC: {"Block": blocker, "Echo": echo}}):
        peer = await RawPeer.connect(sock_path)
        _, frame = peer.conn.request(SVC, "Block", b"", timeout_nano=20_000_000)
        await peer.send(frame)
        event = await peer.next_event()
        assert isinstance(event, ResponseReceived)
        assert event.code == Code.DEADLINE_EXCEEDED
        assert f"{SVC}/Block" in event.message
        assert blocker.cancelled.is_set()
        _, frame = peer.conn.request(SVC, "Echo", b"next")
        await peer.send(frame)
        assert await peer.next_event() == ResponseReceived(3, Code.OK, "", b"next", ())
        await peer.close()


@async_test
async def test_call_timeout_raises_deadline_exceeded_and_the_endpoint_goes_on(
    sock_path: Path,
) -> None:
    blocker = Blocker()
    async with await serve_unix(sock_path, {SVC: {"Block": blocker, "Echo": echo}}):
        client = await connect_unix(sock_path)
        err = await call_error(client, "Block", timeout=0.05)
        assert err.code == Code.DEADLINE_EXCEEDED
        assert f"{SVC}/Block" in err.message
        assert await client.call(SVC, "Echo", b"x", timeout=30.0) == b"x"
        client.close()


@async_test
async def test_a_timeout_that_is_not_positive_sends_nothing() -> None:
    sent: list[bytes] = []
    endpoint = Endpoint(sent.append)
    err = await call_error(endpoint, "Echo", timeout=0)
    assert err.code == Code.DEADLINE_EXCEEDED
    assert sent == []


@async_test
async def test_losing_the_connection_fails_pending_calls_and_cancels_handlers(
    sock_path: Path,
) -> None:
    blocker = Blocker()
    server = await serve_unix(sock_path, {SVC: {"Block": blocker}})
    client = await connect_unix(sock_path)
    pending = asyncio.ensure_future(client.call(SVC, "Block"))
    await blocker.started.wait()
    server.close()
    await server.wait_closed()
    assert blocker.cancelled.is_set()
    with pytest.raises(TtrpcError) as info:
        await pending
    assert info.value.code == Code.UNAVAILABLE
    await client.closed()
    assert client.is_closing()
    err = await call_error(client, "Block")
    assert err.code == Code.UNAVAILABLE
    assert "Block" in err.message


@async_test
async def test_closing_the_client_fails_its_calls_and_cancels_the_servers_handler(
    sock_path: Path,
) -> None:
    blocker = Blocker()
    async with await serve_unix(sock_path, {SVC: {"Block": blocker}}) as server:
        client = await connect_unix(sock_path)
        pending = asyncio.ensure_future(client.call(SVC, "Block"))
        await blocker.started.wait()
        (server_side,) = server.endpoints
        client.close()
        with pytest.raises(TtrpcError) as info:
            await pending
        assert info.value.code == Code.UNAVAILABLE
        await client.closed()
        await server_side.closed()
        assert blocker.cancelled.is_set()
        assert server.endpoints == frozenset()


@async_test
async def test_oversize_request_is_answered_resource_exhausted_and_the_connection_serves(
    sock_path: Path,
) -> None:
    async with await serve_unix(sock_path, {SVC: {"Echo": echo}}):
        peer = await RawPeer.connect(sock_path)
        length = MAX_MESSAGE_SIZE + 1
        await peer.send(struct.pack(">IIBB", length, 1, FrameType.REQUEST, 0))
        event = await peer.next_event()  # answered as soon as the header is read
        assert event.stream_id == 1
        assert isinstance(event, ResponseReceived)
        assert event.code == Code.RESOURCE_EXHAUSTED
        assert str(length) in event.message
        await peer.send(b"\x07" * length)
        peer.conn.request(SVC, "Echo", b"")  # stream 1 is spent
        _, frame = peer.conn.request(SVC, "Echo", b"after")
        await peer.send(frame)
        assert await peer.next_event() == ResponseReceived(3, Code.OK, "", b"after", ())
        await peer.close()


@async_test
async def test_malformed_and_misnumbered_requests_are_refused_and_the_connection_serves(
    sock_path: Path,
) -> None:
    async with await serve_unix(sock_path, {SVC: {"Echo": echo}}):
        peer = await RawPeer.connect(sock_path)
        await peer.send(encode_frame(1, FrameType.REQUEST, b"\xff\xff"))
        event = await peer.next_event()
        assert (event.stream_id, event.code) == (1, Code.INVALID_ARGUMENT)
        assert "malformed ttrpc request" in event.message
        await peer.send(encode_frame(2, FrameType.REQUEST, b""))
        event = await peer.next_event()
        assert (event.stream_id, event.code) == (2, Code.INVALID_ARGUMENT)
        body = Connection().request(SVC, "Echo", b"fine")[1][10:]
        await peer.send(encode_frame(5, FrameType.REQUEST, body))
        assert await peer.next_event() == ResponseReceived(5, Code.OK, "", b"fine", ())
        await peer.close()


@async_test
async def test_an_oversize_call_raises_before_sending_and_spends_no_stream_id(
    sock_path: Path,
) -> None:
    seen: list[int] = []

    async def record(ctx: CallContext, payload: bytes) -> bytes:
        seen.append(ctx.stream_id)
        return b""

    async with await serve_unix(sock_path, {SVC: {"Record": record}}):
        client = await connect_unix(sock_path)
        err = await call_error(client, "Record", b"\0" * MAX_MESSAGE_SIZE)
        assert err.code == Code.RESOURCE_EXHAUSTED
        await client.call(SVC, "Record")
        assert seen == [1]
        client.close()


@async_test
async def test_an_oversize_answer_becomes_resource_exhausted(sock_path: Path) -> None:
    async def huge(ctx: CallContext, payload: bytes) -> bytes:
        return b"\0" * MAX_MESSAGE_SIZE

    async with await serve_unix(sock_path, {SVC: {"Huge": huge, "Echo": echo}}):
        client = await connect_unix(sock_path)
        err = await call_error(client, "Huge")
        assert err.code == Code.RESOURCE_EXHAUSTED
        assert await client.call(SVC, "Echo", b"x") == b"x"
        client.close()


@async_test
async def test_an_error_status_too_large_to_send_goes_cut_short_on_the_same_connection(
    sock_path: Path,
) -> None:
    huge = "x" * MAX_MESSAGE_SIZE

    async def fails(ctx: CallContext, payload: bytes) -> bytes:
        raise ValueError(huge)

    def refuses(ctx: CallContext, payload: bytes) -> bytes:
        raise TtrpcError(Code.INVALID_ARGUMENT, huge)

    async with await serve_unix(sock_path, {SVC: {"Fails": fails, "Refuses": refuses,
                                                  "Echo": echo}}):
        client = await connect_unix(sock_path)
        err = await call_error(client, "Fails", timeout=10)
        assert err.code == Code.UNKNOWN and err.message.startswith("ValueError: xxx")
        assert len(err.message) < 2048
        err = await call_error(client, "Refuses", timeout=10)
        assert err.code == Code.INVALID_ARGUMENT and len(err.message) < 2048
        # A service name that fits in a request but not quoted back in the answer.
        name = "S" * (MAX_MESSAGE_SIZE - 16)
        with pytest.raises(TtrpcError) as info:
            await client.call(name, "M", timeout=10)
        assert info.value.code == Code.UNIMPLEMENTED
        assert info.value.message.startswith("service 'SSS")
        assert await client.call(SVC, "Echo", b"x", timeout=10) == b"x"
        client.close()


@async_test
async def test_an_endpoint_serves_and_calls_on_one_connection() -> None:
    # NRI runs a ttrpc server and a client inside one plugin; here each side is both.
    a: Endpoint
    b: Endpoint

    async def ask_back(ctx: CallContext, payload: bytes) -> bytes:
        return b"b(" + await b.call("A", "Echo", payload) + b")"

    a, b = memory_pair({"A": {"Echo": echo}}, {"B": {"AskBack": ask_back}})
    results = await asyncio.gather(
        a.call("B", "AskBack", b"1"), b.call("A", "Echo", b"2"), a.call("B", "AskBack", b"3")
    )
    assert results == [b"b(1)", b"2", b"b(3)"]
    a.close()
    await a.closed()
    await b.closed()
    assert b.is_closing()


@async_test
async def test_a_bare_endpoint_answers_through_send_one_frame_per_write() -> None:
    sent: list[bytes] = []
    endpoint = Endpoint(sent.append)  # no services, no transport: fed by hand
    sid, frame = Connection().request(SVC, "Anything", b"", metadata=[("k", "v")])
    for i in range(len(frame)):
        endpoint.data_received(frame[i : i + 1])
    (answer,) = sent
    (event,) = Connection().receive(answer)
    assert (event.stream_id, event.code) == (sid, Code.UNIMPLEMENTED)
    endpoint.close()
    await endpoint.closed()
    endpoint.data_received(frame)  # ignored once closed
    assert len(sent) == 1


@async_test
async def test_a_late_response_to_a_timed_out_call_is_dropped() -> None:
    sent: list[bytes] = []
    endpoint = Endpoint(sent.append)
    err = await call_error(endpoint, "Slow", timeout=0.01)
    assert err.code == Code.DEADLINE_EXCEEDED
    (request,) = Connection().receive(sent[0])
    assert isinstance(request, RequestReceived)
    assert request.timeout_nano == 10_000_000
    endpoint.data_received(Connection().response(request.stream_id, b"late"))
    endpoint.data_received(Connection().response(99, b"never asked"))
    pending = asyncio.ensure_future(endpoint.call(SVC, "Next"))
    await asyncio.sleep(0)
    endpoint.data_received(Connection().response(3, b"next"))
    assert await pending == b"next"


@async_test
async def test_a_failing_send_is_unavailable_for_the_caller() -> None:
    def broken(data: bytes) -> None:
        raise BrokenPipeError("mux closed")

    err = await call_error(Endpoint(broken), "Echo")
    assert err.code == Code.UNAVAILABLE
    assert "mux closed" in err.message


@async_test
async def test_an_oversize_or_malformed_response_fails_only_its_call() -> None:
    sent: list[bytes] = []
    endpoint = Endpoint(sent.append)
    first = asyncio.ensure_future(endpoint.call(SVC, "A"))
    second = asyncio.ensure_future(endpoint.call(SVC, "B"))
    third = asyncio.ensure_future(endpoint.call(SVC, "C"))
    await asyncio.sleep(0)
    assert len(sent) == 3  # streams 1, 3, 5
    endpoint.data_received(struct.pack(">IIBB", MAX_MESSAGE_SIZE + 1, 1, FrameType.RESPONSE, 0))
    endpoint.data_received(b"\0" * (MAX_MESSAGE_SIZE + 1))
    endpoint.data_received(encode_frame(3, FrameType.RESPONSE, b"\xff"))
    endpoint.data_received(Connection().response(5, b"fine"))
    with pytest.raises(TtrpcError) as info:
        await first
    assert info.value.code == Code.RESOURCE_EXHAUSTED
    with pytest.raises(TtrpcError) as info:
        await second
    assert info.value.code == Code.INTERNAL
    assert "malformed ttrpc response" in info.value.message
    assert await third == b"fine"


@async_test
async def test_a_plain_handler_is_answered_inline_before_data_received_returns() -> None:
    def reverse(ctx: CallContext, payload: bytes) -> bytes:
        return payload[::-1]

    def refuse(ctx: CallContext, payload: bytes) -> bytes:
        raise TtrpcError(Code.FAILED_PRECONDITION, "no")

    def crash(ctx: CallContext, payload: bytes) -> bytes:
        raise KeyError("gpu9")

    def wrong_type(ctx: CallContext, payload: bytes) -> bytes:
        return "text"  # type: ignore[return-value]

    sent: list[bytes] = []
    endpoint = Endpoint(sent.append, {SVC: {"Reverse": reverse, "Refuse": refuse,
                                             "Crash": crash, "WrongType": wrong_type}})
    client = Connection()
    answers = []
    for method in ("Reverse", "Refuse", "Crash", "WrongType"):
        _, frame = client.request(SVC, method, b"abc", timeout_nano=1)  # deadline long gone
        endpoint.data_received(frame)
        (event,) = client.receive(sent.pop())  # already written: no loop iteration needed
        assert isinstance(event, ResponseReceived)
        answers.append((event.code, event.message, event.payload))
    assert answers[:3] == [(Code.OK, "", b"cba"), (Code.FAILED_PRECONDITION, "no", b""),
                           (Code.UNKNOWN, "KeyError: 'gpu9'", b"")]
    assert answers[3][0] == Code.UNKNOWN and "returned str, not bytes" in answers[3][1]


@async_test
async def test_a_plain_handler_may_answer_later_through_an_awaitable() -> None:
    blocker = Blocker()

    def later(ctx: CallContext, payload: bytes) -> Any:
        return blocker(ctx, payload)  # a coroutine: run in a task like an async handler

    sent: list[bytes] = []
    endpoint = Endpoint(sent.append, {SVC: {"Later": later}})
    client = Connection()
    endpoint.data_received(client.request(SVC, "Later", b"")[1])
    await blocker.started.wait()
    assert sent == []
    blocker.release.set()
    while not sent:
        await asyncio.sleep(0)
    assert client.receive(sent[0]) == [ResponseReceived(1, Code.OK, "", b"released", ())]
    # Closed before its task ever ran: the awaitable is closed, not left never awaited.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        endpoint.data_received(client.request(SVC, "Later", b"")[1])
        endpoint.close()
        await endpoint.closed()
        del endpoint  # its cancelled task holds the awaitable until then
        gc.collect()
    assert [w for w in caught if issubclass(w.category, RuntimeWarning)] == []
    assert len(sent) == 1


@async_test
async def test_requests_beyond_max_in_flight_are_refused_and_plain_ones_still_served() -> None:
    blocker = Blocker()

    def plain(ctx: CallContext, payload: bytes) -> bytes:
        return b"inline"

    sent: list[bytes] = []
    endpoint = Endpoint(sent.append, {SVC: {"Block": blocker, "Plain": plain}}, max_in_flight=2)
    peer = Connection()
    for method in ("Block", "Block", "Block", "Plain"):
        endpoint.data_received(peer.request(SVC, method, b"")[1])
    answers = {e.stream_id: e for f in sent for e in peer.receive(f)}
    assert set(answers) == {5, 7}  # the third Block and Plain; the first two run
    assert answers[5].code == Code.RESOURCE_EXHAUSTED and "2 requests" in answers[5].message
    assert answers[7].payload == b"inline"
    blocker.release.set()
    while len(sent) < 4:
        await asyncio.sleep(0)
    endpoint.data_received(peer.request(SVC, "Block", b"")[1])  # room again
    while len(sent) < 5:
        await asyncio.sleep(0)
    (last,) = peer.receive(sent[-1])
    assert isinstance(last, ResponseReceived) and last.payload == b"released"
    with pytest.raises(ValueError):
        Endpoint(sent.append, max_in_flight=0)
