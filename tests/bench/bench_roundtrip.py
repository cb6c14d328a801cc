"""Benchmark of the whole daemon: CreateContainer round trips through the real NRI socket.

Run: .venv/bin/python tests/bench/bench_roundtrip.py [--requests N] [--concurrency C]
                                                     [--cpu N]
Prints figures, asserts nothing. `nri-accel run` runs as a subprocess on the built-in
demo inventory (8 GPUs) in standalone mode, against the runtime simulator in this
process, which logs warnings only; the daemon logs as deployed (info lines to a file:
its canonical line per container is part of its cost and of the figures below).
--cpu N pins both processes to CPU N: the figures are then the software's own cost,
without the wake-up of a sleeping CPU at each message (on a small VM that adds about
0.1 ms per round trip and most of the run-to-run spread). Measured:
- time from the daemon's process start to its RegisterPlugin reaching the runtime,
  and to being configured and synchronised;
- CreateContainer round trip (encode, ttrpc + mux over the socket, the plugin's whole
  pipeline, its answer decoded here): a container asking for nothing, and one asking
  for a GPU (full adjustment: device nodes, driver mounts, env); p50/p99/max;
- throughput with C CreateContainer calls in flight at a time;
- the daemon's own time per CreateContainer (duration_us of its canonical log line);
- the daemon's peak RSS (VmHWM);
- how long after a restarted runtime comes back the daemon is registered again.
The request is the real CRI-generated CreateContainer of shared/nri-wire's
containerd-2.3.4-e2e capture, with the pod's annotations replaced.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from nri_accel import log
from nri_accel.nri import nri_pb2 as pb
from nri_accel.nri.simulator import PluginConn, Simulator

REPO = Path(__file__).resolve().parents[2]
WIRE = REPO.parent / "shared" / "nri-wire"
DEMO_INVENTORY = REPO / "nri_accel" / "demo" / "inventory.json"
sys.path.insert(0, str(REPO / "tests" / "protocol"))

from wire import runtime_requests  # noqa: E402


def captured_request() -> pb.CreateContainerRequest:
    payload = next(p for _, method, p in runtime_requests(WIRE, "containerd-2.3.4-e2e", 1)
                   if method == "CreateContainer")
    return pb.CreateContainerRequest.FromString(payload)


def variant(base: pb.CreateContainerRequest, annotations: dict[str, str]) -> bytes:
    req = pb.CreateContainerRequest()
    req.CopyFrom(base)
    req.pod.annotations.clear()
    req.pod.annotations.update(annotations)
    return req.SerializeToString()


def percentiles(samples_ns: list[int]) -> str:
    s = sorted(samples_ns)
    p50 = s[len(s) // 2] / 1e6
    p99 = s[min(len(s) - 1, int(len(s) * 0.99))] / 1e6
    return f"p50 {p50:.3f} ms  p99 {p99:.3f} ms  max {s[-1] / 1e6:.3f} ms  (n={len(s)})"


async def round_trips(conn: PluginConn, payload: bytes, n: int) -> list[int]:
    call = conn.client.call
    md = (("containerd-namespace-ttrpc", "k8s.io"),)
    out = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        raw = await call("nri.pkg.api.v1alpha1.Plugin", "CreateContainer", payload,
                         timeout=2.0, metadata=md)
        pb.CreateContainerResponse.FromString(raw)
        out.append(time.perf_counter_ns() - t0)
    return out


async def throughput(conn: PluginConn, payload: bytes, n: int, concurrency: int) -> float:
    per_worker = n // concurrency

    async def worker() -> None:
        await round_trips(conn, payload, per_worker)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return per_worker * concurrency / (time.perf_counter() - t0)


def vm_hwm_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return -1


async def main_async(args: argparse.Namespace) -> None:
    base = captured_request()
    noop = variant(base, {})
    gpu = variant(base, {"devices.nri-accel.io/container.c0": "nvidia.com/gpu=0"})
    with tempfile.TemporaryDirectory(prefix="nri-bench-") as tmp:
        sock, log_file = f"{tmp}/nri.sock", f"{tmp}/daemon.log"
        config = Path(tmp, "config.toml")
        config.write_text('[policy]\nmode = "standalone"\n')
        async with Simulator(sock) as sim:
            started = time.monotonic()
            proc = subprocess.Popen(
                [sys.executable, "-m", "nri_accel.cli", "run", "--socket", sock,
                 "--inventory", str(DEMO_INVENTORY), "--config", str(config),
                 "--log-file", log_file, "--state-dir", f"{tmp}/state"],
                stdin=subprocess.DEVNULL)
            try:
                conn = await sim.wait_for_plugin(timeout=30)
                ready = time.monotonic()
                registered = conn.registered_at  # loop time: time.monotonic()
                assert registered is not None
                print(f"start to RegisterPlugin:     {(registered - started) * 1000:.0f} ms")
                print(f"start to configured+synced:  {(ready - started) * 1000:.0f} ms")

                await round_trips(conn, gpu, 300)  # warm-up
                print(f"CreateContainer, no devices: "
                      f"{percentiles(await round_trips(conn, noop, args.requests))}")
                print(f"CreateContainer, 1 GPU:      "
                      f"{percentiles(await round_trips(conn, gpu, args.requests))}")
                rate = await throughput(conn, gpu, args.requests, args.concurrency)
                print(f"throughput, {args.concurrency} in flight:     {rate:.0f} containers/s")
                print(f"daemon peak RSS (VmHWM):     {vm_hwm_kib(proc.pid) / 1024:.1f} MiB")
            except BaseException:
                proc.terminate()
                raise
        try:
            await asyncio.sleep(args.outage)  # the runtime is away: the daemon retries
            async with Simulator(sock) as sim:
                back = time.monotonic()
                await sim.wait_for_plugin(timeout=30)
                print(f"re-registered after a {args.outage:g} s runtime outage: "
                      f"{(time.monotonic() - back) * 1000:.0f} ms after it came back")
        finally:
            proc.terminate()
            proc.wait(timeout=10)
        durations = [json.loads(line)["duration_us"]
                     for line in Path(log_file).read_text().splitlines()
                     if '"container_created"' in line]
        print(f"daemon time per container:   p50 {statistics.median(durations):.0f} us "
              f"(canonical log line, n={len(durations)})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--outage", type=float, default=3.0,
                        help="seconds the runtime stays away before it comes back")
    parser.add_argument("--cpu", type=int, default=None,
                        help="pin this process and the daemon to this CPU")
    args = parser.parse_args()
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})  # the daemon inherits it
    log.configure(level="warning")  # the simulator's info lines would break up the figures
    asyncio.run(main_async(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
