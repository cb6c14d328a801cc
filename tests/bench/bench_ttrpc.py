"""Benchmark of the ttrpc library: codec cost per message and unix-socket round trips.

Run: .venv/bin/python tests/bench/bench_ttrpc.py [--calls N]
Prints figures, asserts nothing. Message sizes are those of an NRI CreateContainer
(a 4.5 KB request carrying the container and pod, a 230-byte adjustment back; see
shared/nri-wire). The endpoint figure is one request through an Endpoint fed from
memory to a plain handler answering empty, answer written: the library's own CPU
per request, without sockets or another process (steadier than a round trip on a
busy machine). The round trip runs between two processes, as between a runtime
and a plugin: a server process answering from its handler, and a client here.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from nri_accel.ttrpc import Connection, Endpoint, connect_unix

REQUEST_SIZE = 4524
RESPONSE_SIZE = 230
SVC = "nri.pkg.api.v1alpha1.Plugin"
MD = [("containerd-namespace-ttrpc", "k8s.io")]

SERVER = f"""
import asyncio, sys
from nri_accel.ttrpc import serve_unix

async def create(ctx, payload):
    return b"a" * {RESPONSE_SIZE}

async def main():
    server = await serve_unix(sys.argv[1], {{"{SVC}": {{"CreateContainer": create}}}})
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    server.close()
    await server.wait_closed()

asyncio.run(main())
"""


def bench_codec(n: int) -> None:
    client, server = Connection(), Connection()
    payload = os.urandom(REQUEST_SIZE)
    answer = os.urandom(RESPONSE_SIZE)
    frames = [client.request(SVC, "CreateContainer", payload, timeout_nano=2_000_000_000,
                             metadata=MD)[1] for _ in range(n)]
    t0 = time.perf_counter()
    for frame in frames:
        server.receive(frame)
    t1 = time.perf_counter()
    for i in range(n):
        server.response(2 * i + 1, answer)
    t2 = time.perf_counter()
    client2 = Connection()
    for _ in range(n):
        client2.request(SVC, "CreateContainer", payload, timeout_nano=2_000_000_000, metadata=MD)
    t3 = time.perf_counter()
    stream = b"".join(frames)
    chunked = Connection()
    t4 = time.perf_counter()
    for i in range(0, len(stream), 4096):  # the NRI mux's 4 KiB fragments
        chunked.receive(stream[i : i + 4096])
    t5 = time.perf_counter()
    us = 1e6 / n
    print(f"codec: decode request {(t1 - t0) * us:.2f} us, encode response {(t2 - t1) * us:.2f} us,"
          f" encode request {(t3 - t2) * us:.2f} us, decode from 4 KiB chunks"
          f" {(t5 - t4) * us:.2f} us per message ({n} messages of {len(frames[0])} bytes)")


def bench_endpoint(n: int) -> None:
    client = Connection()
    payload = os.urandom(REQUEST_SIZE)
    frames = [client.request(SVC, "CreateContainer", payload, timeout_nano=2_000_000_000,
                             metadata=MD)[1] for _ in range(n)]

    async def one_pass() -> float:
        server = Endpoint(lambda answer: None, {SVC: {"CreateContainer": lambda ctx, p: b""}})
        t0 = time.perf_counter()
        for frame in frames:
            server.data_received(frame)
        return time.perf_counter() - t0

    best = min(asyncio.run(one_pass()) for _ in range(5))  # the least disturbed pass
    print(f"endpoint: request in, empty answer out (plain handler) {best * 1e6 / n:.2f} us"
          f" per request (best of 5 passes)")


async def bench_round_trip(calls: int, concurrency: int) -> None:
    with tempfile.TemporaryDirectory(prefix="ttrpc-bench-") as tmp:
        path = str(Path(tmp) / "s.sock")
        proc = subprocess.Popen([sys.executable, "-c", SERVER, path], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
            client = await connect_unix(path)
            payload = os.urandom(REQUEST_SIZE)
            for _ in range(500):  # warm up
                await client.call(SVC, "CreateContainer", payload, timeout=2.0, metadata=MD)
            samples = []
            for _ in range(calls):
                t0 = time.perf_counter()
                await client.call(SVC, "CreateContainer", payload, timeout=2.0, metadata=MD)
                samples.append(time.perf_counter() - t0)
            samples.sort()
            p50 = statistics.median(samples) * 1e6
            p99 = samples[int(len(samples) * 0.99) - 1] * 1e6
            print(f"round trip (sequential, 2 processes): p50 {p50:.0f} us, p99 {p99:.0f} us,"
                  f" max {samples[-1] * 1e6:.0f} us over {calls} calls")

            async def worker(k: int) -> None:
                for _ in range(k):
                    await client.call(SVC, "CreateContainer", payload, timeout=2.0, metadata=MD)

            per_worker = calls // concurrency
            t0 = time.perf_counter()
            await asyncio.gather(*(worker(per_worker) for _ in range(concurrency)))
            elapsed = time.perf_counter() - t0
            print(f"throughput ({concurrency} calls in flight): "
                  f"{per_worker * concurrency / elapsed:.0f} calls/s")
            client.close()
            await client.closed()
        finally:
            if proc.stdin is not None:
                proc.stdin.close()
            proc.wait(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5000)
    args = parser.parse_args()
    bench_codec(args.calls)
    bench_endpoint(args.calls)
    asyncio.run(bench_round_trip(args.calls, 16))


if __name__ == "__main__":
    main()
