"""Benchmark of a runtime's Synchronize of tens of thousands of containers into the daemon.

Run: .venv/bin/python tests/bench/bench_synchronize.py [--containers 10000 60000]
                                                       [--request-timeout S]
Prints figures, asserts nothing. For each count, a fresh `nri-accel run` (the built-in
demo inventory, as bench_roundtrip.py starts it) registers with the runtime simulator
in this process, which holds that many running containers, four per pod, each a copy of
the real CRI-generated container of shared/nri-wire's containerd-2.3.4-e2e capture
(about 3 KB on the wire: its CRI annotations, env, mounts, Linux resources); one in a
hundred carries a grant annotation, as after a restart of the plugin. Over the 4 MiB
ttrpc limit the simulator splits the Synchronize into chunks, as containerd does.
Measured:
- time from RegisterPlugin to the Synchronize answered, and the daemon's CPU time in
  it (its whole restore: every chunk decoded, kept, converted; the grants rebuilt).
  The wall time includes the simulator's own work in this process (encoding every pod
  and container once, over 100 MB for 60,000 containers, and sending the chunks:
  Python, where containerd's is Go) on the same machine: the daemon's CPU time is its
  share;
- the daemon's peak RSS (VmHWM) and its RSS once synchronised (VmRSS);
- the longest the event loop went without a turn while it did so (no request may hold
  it for more than a few milliseconds): measured in this process, on the same pods and
  containers cut into parts of up to 4 MiB, served by the daemon's stub and plugin
  (the demo inventory) with a task that notes each turn of the loop; and the same for a
  part of one pod holding one container with --annotations annotations (default
  100,000: 1.5 MiB), the text of a grant key in one value of each thousand, so that
  they are read (a CRI client other than kubelet may send that many: Kubernetes caps a
  pod's at 256 KiB).
The simulator's request timeout is raised (--request-timeout) so that a slow machine
does not drop the plugin mid-way: the figure says how long it really took.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import gc
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from bench_roundtrip import DEMO_INVENTORY, captured_request, captures_missing, daemon_command
from loop_turns import held_while

from nri_accel import log
from nri_accel.config import Config, PolicyConfig
from nri_accel.engine import Engine
from nri_accel.inventory import Inventory
from nri_accel.nri import nri_pb2 as pb
from nri_accel.nri.simulator import Simulator, make_pod, sync_fields, sync_part
from nri_accel.nri.stub import Identity, Stub
from nri_accel.plugin import AccelPlugin
from nri_accel.ttrpc import MAX_MESSAGE_SIZE

PER_POD = 4
GRANTED = "nvidia.com/gpu=GPU-4f1c2a3e-8b2d-4c71-9a5e-0d3b6c7e1a10"  # demo GPU 0


def status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return -1


def cpu_seconds(pid: int) -> float:
    """User and system CPU time the process has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def fill(sim: Simulator | SimpleNamespace, containers: int) -> int:
    """`containers` running containers in pods of PER_POD; returns the bytes they take
    on the wire."""
    template = captured_request().container
    template.state = pb.CONTAINER_RUNNING
    size = 0
    pod = None
    for i in range(containers):
        if i % PER_POD == 0:
            pod = make_pod({"name": f"pod-{i // PER_POD}", "namespace": "batch"})
            sim.pods[pod.id] = pod
            size += pod.ByteSize()
        assert pod is not None
        ctr = pb.Container()
        ctr.CopyFrom(template)
        ctr.id, ctr.name, ctr.pod_sandbox_id = f"{i:064x}", f"c{i % PER_POD}", pod.id
        if i % 100 == 0:
            ctr.annotations["nri-accel.io/granted"] = GRANTED
            ctr.annotations["nri-accel.io/shared"] = GRANTED
        sim.containers[ctr.id] = ctr
        size += ctr.ByteSize()
    return size


async def one(containers: int, timeout: float) -> None:
    with tempfile.TemporaryDirectory(prefix="nri-bench-sync-") as tmp:
        sock, log_file = f"{tmp}/nri.sock", f"{tmp}/daemon.log"
        config = Path(tmp, "config.toml")
        config.write_text('[policy]\nmode = "standalone"\n')
        async with Simulator(sock, request_timeout=timeout) as sim:
            size = fill(sim, containers)
            proc = subprocess.Popen(daemon_command(sock, config, log_file),
                                    stdin=subprocess.DEVNULL)
            try:
                while not any(c.registered_at for c in sim.connections):
                    await asyncio.sleep(0.001)
                cpu = cpu_seconds(proc.pid)
                conn = await sim.wait_for_plugin("nri-accel", timeout=timeout + 30)
                synced = time.monotonic()
                cpu = cpu_seconds(proc.pid) - cpu
                assert conn.registered_at is not None
                await asyncio.sleep(0.5)  # let it settle: what it keeps afterwards
                hwm, rss = status_kib(proc.pid, "VmHWM"), status_kib(proc.pid, "VmRSS")
                print(f"{containers:6d} containers ({size / 2**20:6.1f} MiB on the wire, "
                      f"{sim.sync_splits} oversized tries split): synchronised in "
                      f"{(synced - conn.registered_at) * 1000:6.0f} ms, of which the "
                      f"daemon's CPU {cpu * 1000:5.0f} ms; daemon peak RSS "
                      f"{hwm / 1024:6.1f} MiB, after {rss / 1024:6.1f} MiB", flush=True)
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=30)


def parts(containers: int) -> list[bytes]:
    """The Synchronize parts of fill(containers): every pod, then every container, each
    encoded once as its SynchronizeRequest field, joined up to the message limit; all
    parts but the last say "more"."""
    held = SimpleNamespace(pods={}, containers={})
    fill(held, containers)
    pods, ctrs = sync_fields(held.pods.values(), held.containers.values())
    out: list[list[bytes]] = [[]]
    size = 0
    for f in (*pods, *ctrs):
        if size + len(f) > MAX_MESSAGE_SIZE - 1024:
            out.append([])
            size = 0
        out[-1].append(f)
        size += len(f)
    return [sync_part(part, (), i < len(out) - 1) for i, part in enumerate(out)]


def huge_container(annotations: int) -> list[bytes]:
    """A Synchronize of one part: a pod of fill()'s and one of its containers with
    `annotations` more annotations, the text of a grant key in each thousandth value."""
    held = SimpleNamespace(pods={}, containers={})
    fill(held, 1)
    ctr = next(iter(held.containers.values()))
    ctr.annotations.update({f"example.com/k{i:06d}": "nri-accel.io/granted" if i % 1000 == 0
                            else "v" for i in range(annotations)})
    return [sync_part(*sync_fields(held.pods.values(), held.containers.values()), False)]


async def loop_held(payloads: list[bytes]) -> float:
    """The longest the event loop went without a turn while the daemon's stub and plugin
    took the parts `payloads` of a Synchronize, in seconds."""
    engine = Engine(Inventory.load(DEMO_INVENTORY), Config(policy=PolicyConfig("standalone")))
    stub = Stub(AccelPlugin(engine), Identity("nri-accel", "40"), socket_path="/nonexistent")
    gc.collect()
    gc.freeze()  # as `run` does once started: the collector leaves what start-up made
    _trim()

    async def taken() -> None:
        for payload in payloads:
            answer = stub._synchronize(None, payload)
            if not isinstance(answer, bytes):
                await answer

    _, longest = await held_while(taken())
    return longest / 1e9


def _trim() -> None:
    """Have glibc return to the system what this process freed before the measure: the
    parts it built (100 MiB for 60,000 containers) leave freed memory that glibc would
    otherwise give back in some free() inside the measured window (madvise: 10 ms on the
    development VM), a cost of this harness building the runtime's side, which the
    daemon does not. Nothing where the C library is not glibc."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--containers", type=int, nargs="+", default=[10_000, 60_000])
    parser.add_argument("--request-timeout", type=float, default=30.0)
    parser.add_argument("--annotations", type=int, default=100_000)
    args = parser.parse_args()
    if why := captures_missing():
        print(why)
        return 0
    log.configure(level="warning")
    for n in args.containers:
        asyncio.run(one(n, args.request_timeout))
    for n in args.containers:
        payloads = parts(n)
        longest = asyncio.run(loop_held(payloads))
        print(f"{n:6d} containers in {len(payloads)} parts: the event loop held at most "
              f"{longest * 1000:.1f} ms (in process)", flush=True)
    payloads = huge_container(args.annotations)
    longest = asyncio.run(loop_held(payloads))
    print(f"one container with {args.annotations} annotations ({len(payloads[0]) / 2**20:.2f} "
          f"MiB): the event loop held at most {longest * 1000:.1f} ms (in process)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
