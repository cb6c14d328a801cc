"""Benchmark of CreateContainer requests with a huge env or huge annotations, as the
daemon serves them.

Run: .venv/bin/python tests/bench/bench_env.py [--entries N] [--rounds N]
Prints milliseconds per request (median and best of --rounds) and the longest the event
loop went without a turn meanwhile (a task notes each turn), asserts nothing. Each
request is the real CRI-generated CreateContainer of shared/nri-wire's
containerd-2.3.4-e2e capture with N extra env variables (default 100,000: about
1 MiB), served as the daemon serves it: its payload decoded by the stub's
CreateContainer service, AccelPlugin.create_container on the demo inventory (kubernetes
mode, namespace untrusted), the answer encoded. It runs on the event loop, which no
request may hold for more than a few milliseconds: a large request's env and
annotations are read in parts, the loop free in between. Cases:
- the env holds only variables nri-accel does not read (the container asks nothing);
- the same with a CUDA image's variables at the end (NVIDIA_VISIBLE_DEVICES=all is
  rewritten to void: env may not grant there; LD_LIBRARY_PATH, NVIDIA_REQUIRE_CUDA);
- the same with a GPU granted by the device plugin's annotation (the container's
  LD_LIBRARY_PATH extended with the driver's library directory);
- instead of the env, N annotations on the pod that nri-accel does not read (about
  3.4 MiB for 100,000), and the GPU granted;
- instead, N / 2 mounts of the container's own (about 2.5 MiB for 50,000), and the
  GPU granted;
- instead, N CDI annotation keys on the container (`cdi.k8s.io/k<i>`, each naming a
  device), and N env entries defining NVIDIA_REQUIRE_* variables: requests over the
  bounds of nri_accel.request, refused (each had held the loop 0.1-2.3 s when every
  key was parsed; at the default N, over convert.MOST_KEPT too, they are refused as
  the 65,537th is read); a refusal is timed as an answer;
- instead, 13 N env entries of one character (`A`): nearly the most fields 4 MiB holds,
  which protobuf decoded in one call of some 47 ms (a large request's pod and
  container are now decoded a run of fields at a time: nri.fields).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import sys
import time
from typing import Any

from bench_request import CUDA_ENV
from bench_roundtrip import DEMO_INVENTORY, captured_request, captures_missing
from loop_turns import held_while

from nri_accel import log
from nri_accel.config import Config
from nri_accel.engine import Engine
from nri_accel.inventory import Inventory
from nri_accel.nri.stub import Identity, Stub
from nri_accel.plugin import AccelPlugin
from nri_accel.ttrpc import TtrpcError


def payload(entries: int, tail: tuple[str, ...], annotations: dict[str, str],
            pod_annotations: int = 0, mounts: int = 0, tiny: int = 0) -> bytes:
    req = captured_request()
    for i in range(mounts):
        req.container.mounts.add(destination=f"/data/{i:06d}", source=f"/srv/{i:06d}",
                                 type="bind", options=["rbind", "ro"])
    req.pod.annotations.clear()
    req.pod.annotations.update({f"example.com/key-{i:06d}": "v" * 8
                                for i in range(pod_annotations)})
    req.container.annotations.update(annotations)
    req.container.env.extend(f"K{i:06d}=v" for i in range(entries))
    req.container.env.extend(tail)
    req.container.env.extend(["A"] * tiny)
    return req.SerializeToString()


async def served(serve: Any, raw: bytes) -> tuple[int, int]:
    """Nanoseconds `serve` took to answer `raw`, and the longest the event loop went
    without a turn meanwhile."""

    async def answered() -> int:
        t0 = time.perf_counter_ns()
        try:
            answer = serve(None, raw)
            if not isinstance(answer, bytes):
                await answer
        except TtrpcError:  # refused: the runtime gets the error as the answer
            pass
        return time.perf_counter_ns() - t0

    return await held_while(answered())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    if why := captures_missing():
        print(why)
        return 0
    log.configure(level="error")  # the canonical lines (and refusals) are not this figure
    plugin = AccelPlugin(Engine(Inventory.load(DEMO_INVENTORY), Config()))
    serve = Stub(plugin, Identity("bench", "99"))._services()["CreateContainer"]
    gpu = {"devices.nri-accel.io": "nvidia.com/gpu=0"}  # the device plugin's grant
    cases = {
        "only variables nri-accel does not read": payload(args.entries, (), {}),
        "... and a CUDA image's (void rewrite)": payload(args.entries, CUDA_ENV, {}),
        "... and a GPU granted (LD_LIBRARY_PATH)": payload(args.entries, CUDA_ENV, gpu),
        "pod annotations instead, and a GPU granted": payload(0, CUDA_ENV, gpu,
                                                              args.entries),
        "mounts instead (half as many), a GPU granted": payload(0, CUDA_ENV, gpu,
                                                                mounts=args.entries // 2),
        "CDI keys on the container instead (refused)": payload(0, (), {
            f"cdi.k8s.io/k{i:06d}": "example.com/dev=a" for i in range(args.entries)}),
        "NVIDIA_REQUIRE_* entries instead (refused)": payload(0, tuple(
            f"NVIDIA_REQUIRE_{i:06d}=cuda>=12.0" for i in range(args.entries)), {}),
        "one-character env entries instead": payload(0, (), {}, tiny=13 * args.entries),
    }
    gc.collect()
    gc.freeze()  # as `run` does once started: the collector leaves what start-up made
    print(f"CreateContainer with {args.entries} extra env variables or annotations; ms "
          f"per request, decoded, served and answered ({args.rounds} rounds), and the "
          "longest the event loop was held meanwhile")
    for name, raw in cases.items():
        times, held = zip(*(asyncio.run(served(serve, raw))  # it replaces its own grant
                            for _ in range(args.rounds)), strict=True)
        print(f"  {name:42} ({len(raw) / 2**20:.2f} MiB)  median "
              f"{statistics.median(times) / 1e6:6.2f}  best {min(times) / 1e6:6.2f}  "
              f"loop held: median {statistics.median(held) / 1e6:5.2f}  "
              f"max {max(held) / 1e6:5.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
