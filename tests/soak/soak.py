"""Soak: 100,000 CreateContainer/RemoveContainer pairs through the real daemon.

Run: make soak, or .venv/bin/python tests/soak/soak.py [--containers N] [--interval N]
                                                       [--cpu N]
Prints figures, asserts nothing. `nri-accel run` runs as a subprocess on the built-in
demo inventory (8 GPUs, 3 MIG devices) in standalone mode, logging as deployed (info
lines to a file), against the runtime simulator in this process, which creates and then
removes one container after another (each a new container id; 50 pods), the request
mixed as on a busy node:

    60 %  asks for nothing (the CRI container of shared/nri-wire's capture)
    15 %  one GPU by index (a pod annotation), 10 %  a count of two GPUs
     8 %  NVIDIA_VISIBLE_DEVICES=all in the env (standalone: every GPU, shared)
     2 %  a MIG device,  4 %  an unknown device (refused: the error path)
     1 %  a large env (2,000 variables) asking for a GPU

Every --interval containers it prints the CreateContainer round trips of that interval
(p50, p99, max, as the simulator sees them), the daemon's RSS (VmRSS, and VmHWM), its
open file descriptors, and its asyncio tasks: sent SIGUSR1, the daemon's stub logs a
`stub_state` line, read back from its log. The first interval is the warm-up (memos and
allocator pools filling); after it, RSS, fds and tasks should stay flat.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS / "bench"))
sys.path.insert(0, str(TESTS / "protocol"))

from bench_roundtrip import captured_request, daemon_command, percentiles  # noqa: E402

from nri_accel import log  # noqa: E402
from nri_accel.nri import nri_pb2 as pb  # noqa: E402
from nri_accel.nri.simulator import PluginError, Simulator, make_pod  # noqa: E402

PODS = 50
KEY = "devices.nri-accel.io/container.c0"
# (share in 100, what the request sets): pod annotations, container env
Variant = tuple[dict[str, str], list[str]]
MIX: list[tuple[int, Callable[[int], Variant]]] = [
    (60, lambda i: ({}, [])),
    (15, lambda i: ({KEY: f"nvidia.com/gpu={i % 7}"}, [])),
    (10, lambda i: ({KEY: "nvidia.com/gpu: 2"}, [])),
    (8, lambda i: ({}, ["NVIDIA_VISIBLE_DEVICES=all"])),
    (2, lambda i: ({KEY: f"nvidia.com/mig=7:{i % 3}"}, [])),
    (4, lambda i: ({KEY: "nvidia.com/gpu=99"}, [])),
    (1, lambda i: ({KEY: "nvidia.com/gpu=0"}, [f"V{j}=x" for j in range(2000)])),
]
CHOICES = [make for share, make in MIX for _ in range(share)]


def status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return -1


async def tasks_of(proc: subprocess.Popen[bytes], log_file: Path) -> int | str:
    """The daemon's asyncio task count, from the `stub_state` line SIGUSR1 makes it log."""
    sent = datetime.now().astimezone()
    proc.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        with open(log_file, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
            tail = f.read().decode(errors="replace").splitlines()
        for line in reversed(tail):
            if '"stub_state"' in line:
                entry = json.loads(line)
                if datetime.fromisoformat(entry["timestamp"]) >= sent:
                    return int(entry["tasks"])
                break
        await asyncio.sleep(0.02)
    return "?"


async def soak(args: argparse.Namespace) -> None:
    template = captured_request()
    pods = [make_pod({"name": f"soak-{n}", "namespace": "soak"}) for n in range(PODS)]
    with tempfile.TemporaryDirectory(prefix="nri-soak-") as tmp:
        sock, log_file = f"{tmp}/nri.sock", Path(tmp, "daemon.log")
        config = Path(tmp, "config.toml")
        config.write_text('[policy]\nmode = "standalone"\n')
        async with Simulator(sock, request_timeout=10) as sim:
            proc = subprocess.Popen(daemon_command(sock, config, str(log_file)),
                                    stdin=subprocess.DEVNULL)
            try:
                await sim.wait_for_plugin("nri-accel", timeout=30)
                print(f"soak: {args.containers} CreateContainer + RemoveContainer, "
                      f"figures every {args.interval}", flush=True)
                first_rss = None
                samples: list[int] = []
                refused = 0
                for i in range(args.containers):
                    annotations, env = CHOICES[(i * 37) % 100](i)
                    pod = pods[i % PODS]
                    pod_msg = pb.PodSandbox()
                    pod_msg.CopyFrom(pod)
                    pod_msg.annotations.update(annotations)
                    ctr = pb.Container()
                    ctr.CopyFrom(template.container)
                    ctr.id, ctr.pod_sandbox_id = f"{i:064x}", pod.id
                    ctr.env.extend(env)
                    t0 = time.perf_counter_ns()
                    try:
                        await sim.create_container(pod_msg, ctr)
                    except PluginError:
                        refused += 1
                    samples.append(time.perf_counter_ns() - t0)
                    await sim.remove_container(pod_msg, ctr)
                    if (i + 1) % args.interval == 0:
                        rss = status_kib(proc.pid, "VmRSS")
                        first_rss = first_rss if first_rss is not None else rss
                        print(f"{i + 1:7d}  create {percentiles(samples)}  "
                              f"RSS {rss / 1024:5.1f} MiB (peak "
                              f"{status_kib(proc.pid, 'VmHWM') / 1024:5.1f})  "
                              f"fds {len(os.listdir(f'/proc/{proc.pid}/fd'))}  "
                              f"tasks {await tasks_of(proc, log_file)}  "
                              f"refused {refused}", flush=True)
                        samples = []
                if first_rss is not None:
                    last = status_kib(proc.pid, "VmRSS")
                    print(f"RSS after warm-up (first figure) to the end: "
                          f"{(last - first_rss) / 1024:+.1f} MiB", flush=True)
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--containers", type=int, default=100_000)
    parser.add_argument("--interval", type=int, default=10_000)
    parser.add_argument("--cpu", type=int, default=None,
                        help="pin this process and the daemon to this CPU")
    args = parser.parse_args()
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})  # the daemon inherits it
    log.configure(level="warning")
    asyncio.run(soak(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
