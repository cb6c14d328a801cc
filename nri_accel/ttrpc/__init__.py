"""ttrpc for Python: containerd's lightweight RPC protocol, sans-IO codec and asyncio endpoints.

A standalone library: it imports nothing from nri_accel outside this subpackage and
has its own exception root, TtrpcError. Layers, bottom up:
- codec: the 10-byte frame header, FrameDecoder (bytes cut anywhere -> frames),
  encode_frame, the 4 MiB MAX_MESSAGE_SIZE;
- protocol: Connection, one connection's sans-IO state (bytes -> events, calls ->
  bytes) over the Request/Response envelope of api/ttrpc.proto (ttrpc_pb2);
- endpoint: Endpoint, the asyncio server/client of one connection over any transport;
- flow: ReadGate, when a socket adapter stops reading (its write buffer is full),
  and GatedReader, the adapters' stream protocol (a reused read buffer, gated);
- unix: serve_unix / connect_unix, Endpoints on unix sockets.
See README.md beside this file for the API and an example.
"""

from .codec import (
    HEADER_SIZE,
    MAX_MESSAGE_SIZE,
    Flags,
    Frame,
    FrameDecoder,
    FrameType,
    OversizeFrame,
    encode_frame,
)
from .endpoint import CallContext, Endpoint, Handler, Services
from .errors import Code, TtrpcError
from .protocol import (
    Connection,
    Event,
    FrameIgnored,
    Metadata,
    RequestReceived,
    ResponseReceived,
    StreamError,
)
from .unix import UnixServer, connect_unix, serve_unix

__all__ = [
    "HEADER_SIZE",
    "MAX_MESSAGE_SIZE",
    "CallContext",
    "Code",
    "Connection",
    "Endpoint",
    "Event",
    "Flags",
    "Frame",
    "FrameDecoder",
    "FrameIgnored",
    "FrameType",
    "Handler",
    "Metadata",
    "OversizeFrame",
    "RequestReceived",
    "ResponseReceived",
    "Services",
    "StreamError",
    "TtrpcError",
    "UnixServer",
    "connect_unix",
    "encode_frame",
    "serve_unix",
]
