"""Reading the NRI wire captures (../shared/nri-wire, see its README) for the tests.

A capture is what a relay between containerd's NRI runtime and a reference Go plugin
read from each side: `raw` records (relay connection, direction, bytes, in read order)
and `decoded` records (one per ttrpc message, decoded by the Go side). Helpers here
only read the files; decoding the bytes is what the tests check, with the project's
own mux, ttrpc and nri_pb2 (FrameReader and runtime_requests use them to cut the
streams into messages once the decoding tests have shown they do that right).
"""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nri_accel.nri.mux import Demux
from nri_accel.nri.stub import Identity, Stub
from nri_accel.ttrpc import Frame, FrameDecoder, FrameType, ttrpc_pb2

RUNTIME_TO_PLUGIN = "runtime->plugin"
PLUGIN_TO_RUNTIME = "plugin->runtime"

CAPTURES = (
    "create-devinj",
    "lifecycle-all-events",
    "sync-300-containers",
    "split-sync-1500-containers",
    "containerd-2.3.4-e2e",
    "crio-1.36.3-lifecycle",
    "crio-1.36.3-failed-create",
    "crio-1.36.3-restart-sync",
)


@dataclass(frozen=True)
class Read:
    """One read() of the relay: `data` from `direction` on relay connection `conn`."""

    seq: int
    conn: int
    direction: str
    data: bytes


def _open(path: Path) -> Any:
    if path.exists():
        return path.open("rt", encoding="utf-8")
    return gzip.open(path.with_name(path.name + ".gz"), "rt", encoding="utf-8")


def reads(wire_dir: Path, capture: str) -> list[Read]:
    with _open(wire_dir / f"{capture}.raw.jsonl") as f:
        return [Read(r["seq"], r["conn"], r["dir"], bytes.fromhex(r["hex"]))
                for r in map(json.loads, f)]


def decoded(wire_dir: Path, capture: str) -> list[dict[str, Any]]:
    with _open(wire_dir / f"{capture}.decoded.jsonl") as f:
        return [json.loads(line) for line in f]


def stream(wire_dir: Path, capture: str, conn: int, direction: str) -> bytes:
    """Every byte one side sent on relay connection `conn`, in order."""
    return b"".join(r.data for r in reads(wire_dir, capture)
                    if r.conn == conn and r.direction == direction)


def relay_conns(wire_dir: Path, capture: str) -> list[int]:
    return sorted({r.conn for r in reads(wire_dir, capture)})


def payload_type(record: dict[str, Any]) -> str:
    """The short protobuf type name the Go side decoded a message's payload as."""
    return record["payload"].split(" ", 1)[0].rsplit(".", 1)[1]


def frames(data: bytes) -> Iterator[tuple[int, int]]:
    """(conn id, payload length) of each mux frame of a whole stream (reference parser
    for the tests; the header is simple enough to state twice)."""
    pos = 0
    while pos < len(data):
        conn = int.from_bytes(data[pos:pos + 4], "big")
        length = int.from_bytes(data[pos + 4:pos + 8], "big")
        yield conn, length
        pos += 8 + length


class FrameReader:
    """Counts and keeps the ttrpc frames of one side's mux byte stream."""

    def __init__(self) -> None:
        self.demux = Demux()
        self.decoders: dict[int, FrameDecoder] = {}
        self.frames: list[tuple[int, Frame]] = []

    def feed(self, data: bytes) -> None:
        for conn, chunk in self.demux.feed(data):
            for frame in self.decoders.setdefault(conn, FrameDecoder()).feed(chunk):
                assert isinstance(frame, Frame)
                self.frames.append((conn, frame))


def runtime_requests(wire_dir: Path, capture: str, relay: int) -> list[tuple[int, str, bytes]]:
    """(stream id, method, NRI payload) of each request the runtime sent on conn 1."""
    reader = FrameReader()
    for read in reads(wire_dir, capture):
        if read.conn == relay and read.direction == RUNTIME_TO_PLUGIN:
            reader.feed(read.data)
    out = []
    for conn, frame in reader.frames:
        if conn == 1 and frame.type == FrameType.REQUEST:
            req = ttrpc_pb2.Request.FromString(frame.payload)
            out.append((frame.stream_id, req.method, req.payload))
    return out


async def replay(wire_dir: Path, capture: str, relay: int,
                 plugin: Any) -> tuple[list[tuple[int, Frame]], Any, int]:
    """Run a Stub serving `plugin` against one recorded runtime connection, as a
    pre-registered plugin on one end of a socketpair; (its frames, the plugin, rc).

    The runtime->plugin reads are written in their original chunking; before each, the
    stub must have answered as many messages as the Go plugin had at that point of the
    recording, so the conversation happens in the recorded order (Configure right
    after RegisterPlugin, each split Synchronize chunk after the previous answer)."""
    loop = asyncio.get_running_loop()
    runtime_end, plugin_end = socket.socketpair()
    runtime_end.setblocking(False)

    stub = Stub(plugin, Identity("recorder", "10"), fd=plugin_end.detach())
    served = loop.create_task(stub.run())
    ours, go = FrameReader(), FrameReader()

    async def pump() -> None:
        while data := await loop.sock_recv(runtime_end, 1 << 20):
            ours.feed(data)

    pumping = loop.create_task(pump())

    async def wait_for_answers(count: int) -> None:
        while len(ours.frames) < count:
            assert not pumping.done(), "the stub closed the connection"
            await asyncio.sleep(0.001)

    for read in reads(wire_dir, capture):
        if read.conn != relay:
            continue
        if read.direction == PLUGIN_TO_RUNTIME:
            go.feed(read.data)
            continue
        await asyncio.wait_for(wait_for_answers(len(go.frames)), 10)
        await loop.sock_sendall(runtime_end, read.data)
    await asyncio.wait_for(wait_for_answers(len(go.frames)), 10)
    # The read pending on runtime_end ends first: uvloop closes a socket only once no
    # sock_recv() waits on it (asyncio's loop at once), and the stub waits for that close.
    pumping.cancel()
    await asyncio.gather(pumping, return_exceptions=True)
    runtime_end.close()
    rc = await asyncio.wait_for(served, 10)
    return ours.frames, plugin, rc
