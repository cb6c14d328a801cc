"""The asyncio side of one ttrpc connection: serve handlers, make calls, over any transport.

Owns: Endpoint (fed bytes by its transport, writes through a `send` callable, so it
runs over a socket, a multiplexed sub-connection or an in-memory pipe alike),
CallContext (what a handler learns about its call) and the Handler/Services types.
Imports asyncio, logging and this package's protocol and errors; no sockets (see
unix.py for those).

Server side: a handler is an async function, or a plain one returning bytes (or an
awaitable of bytes). A plain handler runs at once, as its request is decoded, and
its answer is written before the next frame is looked at: no task, no loop
iteration, the cheapest path, for handlers that are quick and do no I/O. An
awaitable runs in its own task (such handlers run concurrently). The answer is the
handler's bytes, the status of a TtrpcError it raises, DEADLINE_EXCEEDED when the
request's `timeout_nano` passes while an awaitable runs (it is cancelled; a plain
handler cannot be interrupted and its answer stands), UNKNOWN with the exception's
text for any other exception (an error status too large to send goes with its
message cut short). Nothing a peer sends or a handler does closes the connection.
Client side: `call()` sends on the next odd stream id and waits for the response
with that id; any number of calls may be in flight. Closing fails pending calls with
UNAVAILABLE and cancels handlers.

Bounded work: at most `max_in_flight` handler tasks run at once; a request that
would start one more is answered RESOURCE_EXHAUSTED at once (plain handlers, which
run inline, are never refused). Refusing, rather than pausing the transport until a
task ends, keeps the connection read, so a handler waiting on its own call to the
peer still gets the answer. With the socket adapters' flow control (flow.py), a
peer that pipelines requests makes this side hold bounded memory.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

from msgspec import Struct

from .codec import Bytes, FrameType
from .errors import Code, TtrpcError
from .protocol import Connection, Metadata, RequestReceived, ResponseReceived, StreamError

_log = logging.getLogger(__name__)

_REQUEST = int(FrameType.REQUEST)
_RESPONSE = int(FrameType.RESPONSE)
_CUT_MESSAGE = 1024  # characters of an error message kept when the whole does not fit

DEFAULT_MAX_IN_FLIGHT = 128
"""Handler tasks one endpoint runs at once; a request beyond is refused (module doc)."""


class CallContext(Struct, frozen=True):
    """What a handler knows about its call.

    `metadata` holds the request's (key, value) pairs in wire order (a key may
    repeat); `deadline` is on the event loop's clock (`loop.time()`), None when the
    caller set no timeout.
    """

    service: str
    method: str
    metadata: Metadata
    deadline: float | None
    stream_id: int


Handler = Callable[[CallContext, bytes], Awaitable[bytes] | bytes]
"""A function answering one method: (ctx, request payload) -> response payload; async,
or plain (run inline: quick and no I/O) returning bytes or an awaitable of bytes."""

Services = Mapping[str, Mapping[str, Handler]]
"""{service name: {method name: handler}}, e.g. {"nri.pkg.api.v1alpha1.Plugin": {...}}."""


class Endpoint:
    """One ttrpc connection: a server of `services`, a client through `call()`, or both.

    The transport feeds it with data_received() (bytes cut anywhere) and reports its
    end with connection_lost(); the endpoint writes whole frames through `send`, one
    call per frame. `on_close`, when given, is how close() shuts the transport (which
    must then report connection_lost); without it close() completes at once. At most
    `max_in_flight` async handlers run at once. Create and use it on the event
    loop's thread.
    """

    def __init__(
        self,
        send: Callable[[bytes], object],
        services: Services | None = None,
        *,
        on_close: Callable[[], object] | None = None,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    ) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, not {max_in_flight}")
        self._send = send
        self._services = {name: dict(methods) for name, methods in (services or {}).items()}
        self._on_close = on_close
        self._max_in_flight = max_in_flight
        self._conn = Connection()
        self._pending: dict[int, asyncio.Future[bytes]] = {}
        self._handlers: dict[int, asyncio.Task[None]] = {}
        self._cancelled: list[asyncio.Task[None]] = []
        self._closing_reason = ""
        self._closed = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None  # the running loop, once used

    # -- transport side ---------------------------------------------------------------

    def data_received(self, data: Bytes) -> None:
        """Feed bytes read from the transport (a view of a reused read buffer is fine)."""
        if self._closing_reason:
            return
        for event in self._conn.receive(data):
            if isinstance(event, RequestReceived):
                self._start(event)
            elif isinstance(event, ResponseReceived):
                self._resolve(event)
            elif isinstance(event, StreamError):
                self._refused(event)
            else:
                _log.debug("ttrpc_frame_ignored %s", event)

    def connection_lost(self, exc: BaseException | None) -> None:
        """The transport is gone: fail pending calls with UNAVAILABLE, cancel handlers."""
        self._shutdown(
            "ttrpc connection closed" if exc is None else f"ttrpc connection lost: {exc}"
        )
        self._closed.set()

    # -- user side --------------------------------------------------------------------

    async def call(
        self,
        service: str,
        method: str,
        payload: bytes = b"",
        *,
        timeout: float | None = None,
        metadata: Iterable[tuple[str, str]] = (),
    ) -> bytes:
        """Call `service`/`method` with `payload`; return the response payload.

        `timeout` (seconds) bounds the wait and travels as the request's deadline.
        Raises TtrpcError: the peer's status when it is not OK, DEADLINE_EXCEEDED when
        no answer came in time, UNAVAILABLE when the connection is or gets closed,
        RESOURCE_EXHAUSTED when the request is over the size limit (nothing is sent).
        """
        if self._closing_reason:
            raise TtrpcError(
                Code.UNAVAILABLE, f"cannot call {service}/{method}: {self._closing_reason}"
            )
        timeout_nano = 0
        if timeout is not None:
            if timeout <= 0:
                message = f"{service}/{method}: timeout {timeout} s is not positive"
                raise TtrpcError(Code.DEADLINE_EXCEEDED, message)
            timeout_nano = max(1, round(timeout * 1e9))
        loop = self._loop or self._running_loop()
        stream_id, frame = self._conn.request(
            service, method, payload, timeout_nano=timeout_nano, metadata=metadata
        )
        future: asyncio.Future[bytes] = loop.create_future()
        self._pending[stream_id] = future
        timer = None
        try:
            try:
                self._send(frame)
            except Exception as exc:
                raise TtrpcError(
                    Code.UNAVAILABLE, f"cannot send {service}/{method}: {exc}"
                ) from exc
            if timeout is not None:
                timer = loop.call_later(timeout, _expire, future, service, method, timeout)
            return await future
        finally:
            del self._pending[stream_id]
            if timer is not None:
                timer.cancel()

    def close(self) -> None:
        """Fail pending calls with UNAVAILABLE, cancel running handlers, shut the transport."""
        if self._closing_reason:
            return
        self._shutdown("ttrpc endpoint closed")
        if self._on_close is None:
            self._closed.set()
        else:
            self._on_close()

    def is_closing(self) -> bool:
        """True once close() was called or the connection was lost."""
        return bool(self._closing_reason)

    async def closed(self) -> None:
        """Wait until the connection is closed and cancelled handlers have finished."""
        await self._closed.wait()
        if self._cancelled:
            await asyncio.wait(self._cancelled)

    # -- internals --------------------------------------------------------------------

    def _shutdown(self, reason: str) -> None:
        if self._closing_reason:
            return
        self._closing_reason = reason
        for future in self._pending.values():
            if not future.done():
                future.set_exception(TtrpcError(Code.UNAVAILABLE, reason))
        self._cancelled = list(self._handlers.values())
        for task in self._cancelled:
            task.cancel()

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        self._loop = asyncio.get_running_loop()
        return self._loop

    def _start(self, req: RequestReceived) -> None:
        methods = self._services.get(req.service)
        handler = None if methods is None else methods.get(req.method)
        if handler is None:
            what = (
                f"service {req.service!r}"
                if methods is None
                else f"method {req.method!r} of service {req.service!r}"
            )
            self._write(
                self._error_frame(req.stream_id, Code.UNIMPLEMENTED, f"{what} is not implemented")
            )
            return
        loop = self._loop or self._running_loop()
        deadline = loop.time() + req.timeout_nano / 1e9 if req.timeout_nano else None
        ctx = CallContext(req.service, req.method, req.metadata, deadline, req.stream_id)
        try:
            result = handler(ctx, req.payload)
            if not isinstance(result, bytes) and inspect.isawaitable(result):
                if len(self._handlers) >= self._max_in_flight:
                    self._refuse_busy(req, result)
                    return
                task = loop.create_task(self._serve(result, ctx))
                if inspect.iscoroutine(result):
                    # A task cancelled before its first step never starts `result`:
                    # closing it keeps it from being reported as never awaited.
                    task.add_done_callback(lambda _: result.close())
                self._handlers[req.stream_id] = task
                return
            frame = self._answer(ctx, result)
        except asyncio.CancelledError:  # raised by a plain handler: not a cancellation
            frame = self._cancelled_frame(ctx)
        except Exception as exc:
            frame = self._failure_frame(ctx, exc)
        if not self._closing_reason:  # the handler may have closed the endpoint
            self._write(frame)

    def _refuse_busy(self, req: RequestReceived, result: Awaitable[bytes]) -> None:
        if inspect.iscoroutine(result):
            result.close()  # never started: not "never awaited"
        message = (f"{req.service}/{req.method} refused: {self._max_in_flight} "
                   "requests of this connection are already being handled")
        _log.warning("ttrpc_request_refused stream_id=%d reason=busy", req.stream_id)
        self._write(self._error_frame(req.stream_id, Code.RESOURCE_EXHAUSTED, message))

    async def _serve(self, pending: Awaitable[bytes], ctx: CallContext) -> None:
        stream_id = ctx.stream_id
        timeout = None
        try:
            if ctx.deadline is None:
                result = await pending
            else:
                timeout = asyncio.timeout_at(ctx.deadline)
                async with timeout:
                    result = await pending
            frame = self._answer(ctx, result)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self._closing_reason or (task is not None and task.cancelling()):
                raise
            frame = self._cancelled_frame(ctx)
        except Exception as exc:
            if isinstance(exc, TimeoutError) and timeout is not None and timeout.expired():
                message = f"{ctx.service}/{ctx.method} did not finish before its deadline"
                frame = self._error_frame(stream_id, Code.DEADLINE_EXCEEDED, message)
            else:
                frame = self._failure_frame(ctx, exc)
        finally:
            del self._handlers[stream_id]
        if not self._closing_reason:
            self._write(frame)

    def _answer(self, ctx: CallContext, result: object) -> bytes:
        """The response frame of a handler's result. Raises TypeError when it is not
        bytes, TtrpcError when it is over the size limit (answered as a handler's own)."""
        if not isinstance(result, bytes):
            raise TypeError(
                f"handler of {ctx.service}/{ctx.method} returned "
                f"{type(result).__name__}, not bytes"
            )
        return self._conn.response(ctx.stream_id, result)

    def _cancelled_frame(self, ctx: CallContext) -> bytes:
        return self._error_frame(
            ctx.stream_id, Code.CANCELLED, f"handler of {ctx.service}/{ctx.method} was cancelled"
        )

    def _failure_frame(self, ctx: CallContext, exc: Exception) -> bytes:
        """The answer to a handler's exception: a TtrpcError's own status, else UNKNOWN."""
        if isinstance(exc, TtrpcError):
            return self._error_frame(ctx.stream_id, exc.code, exc.message, exc.details)
        _log.error(
            "ttrpc_handler_failed service=%s method=%s",
            ctx.service, ctx.method, exc_info=exc,
        )
        text = str(exc)
        message = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
        return self._error_frame(ctx.stream_id, Code.UNKNOWN, message)

    def _error_frame(
        self, stream_id: int, code: Code, message: str, details: Sequence[Any] = ()
    ) -> bytes:
        """An error status on `stream_id`. One over the size limit (a handler's huge
        message, a peer's huge service name quoted back) goes with its message cut short
        and no details: the peer still gets its answer and the connection its next frame."""
        try:
            return self._conn.response(stream_id, code=code, message=message, details=details)
        except TtrpcError:
            cut = f"{message[:_CUT_MESSAGE]}... ({len(message)} characters, cut to fit)"
            return self._conn.response(stream_id, code=code, message=cut)

    def _write(self, frame: bytes) -> None:
        """Send an answer; a failing transport is logged here, its end comes as connection_lost."""
        try:
            self._send(frame)
        except Exception:
            _log.exception("ttrpc_send_failed")

    def _resolve(self, resp: ResponseReceived) -> None:
        future = self._pending.get(resp.stream_id)
        if future is None or future.done():
            _log.debug("ttrpc_response_unmatched stream_id=%d", resp.stream_id)
        elif resp.code == Code.OK:
            future.set_result(resp.payload)
        else:
            future.set_exception(TtrpcError(resp.code, resp.message, details=resp.details))

    def _refused(self, err: StreamError) -> None:
        _log.warning(
            "ttrpc_frame_refused stream_id=%d type=%d code=%s message=%s",
            err.stream_id, err.frame_type, err.code.name, err.message,
        )
        if err.frame_type == _REQUEST:
            self._write(self._error_frame(err.stream_id, err.code, err.message))
        elif err.frame_type == _RESPONSE:
            future = self._pending.get(err.stream_id)
            if future is not None and not future.done():
                future.set_exception(TtrpcError(err.code, err.message))


def _expire(future: asyncio.Future[bytes], service: str, method: str, timeout: float) -> None:
    if not future.done():
        message = f"{service}/{method}: no response within {timeout} s"
        future.set_exception(TtrpcError(Code.DEADLINE_EXCEEDED, message))
